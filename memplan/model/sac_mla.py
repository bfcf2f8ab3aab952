"""Op-level checkpointing (``memplan.model.sac_ops``) of a multi-head latent attention block
(``memplan.model.mla``): the ops of one MLA layer's attention a policy counts, in execution
order, as transformers runs them (models/deepseek_v3/modeling_deepseek_v3.py
``DeepseekV3Attention.forward``):

- ``q_a_proj`` (``mla.q_a``, replicated: an ``mm`` ``q_lora_rank`` wide), ``q_a_layernorm``
  (``mla.q_norm.*``, an upcast RMSNorm: ``DeepseekV3RMSNorm.forward``), ``q_b_proj``
  (``mla.q_b``, heads x (nope + rope) wide; without ``q_lora_rank`` one ``q_proj``,
  ``mla.q_proj``). Its output is saved by no one: the split's no-RoPE part is a view the
  query's concatenation reads, RoPE's products save ``cos`` and ``sin``.
- ``kv_a_proj_with_mqa`` (``mla.kv_a``, replicated, kv_lora_rank + rope wide),
  ``kv_a_layernorm`` on its latent part (``mla.kv_norm.*``; in fp32 the norm's input is a
  slice of this output, which it keeps whole), ``kv_b_proj`` (``mla.kv_b``: the value is a
  view of its output, which the kernel's saved value keeps alive, ``mla.kv_up``).
- RoPE's four products of width ``qk_rope_head_dim`` (``apply_rotary_pos_emb``, or its
  interleaved form, whose reshape copies are no ops a policy counts): no item, their outputs
  are ``add``s.
- the query's and the key's concatenations (``torch.cat((q_pass, q_rot), dim=-1)``, then
  k's: ``aten.cat`` of width ``head_dim``; ``mla.q``, ``mla.k``, what the kernel saves of q
  and k), the kernel (``mla.out`` with ``mla.lse``: CUDA's memory-efficient SDPA for the
  value head narrower than the query head) and ``o_proj`` (``mla.o_proj``, saved by no one).

The latent norms are named by their ops where the layer norms are (``sac_ops.
_norms_nameable``); in fp32 their input is the down projection's output itself (no cast),
which that projection's item keeps (its ``terms``). The items are made by ``sac_ops.
_mla_ops``; this module holds what the policy emitters read too.
"""

from __future__ import annotations

from memplan.model.mla import mla_linears
from memplan.spec import ModelSpec

# the family of ``aten.cat`` (the query's and the key's concatenations)
CAT = "cat"


# ``mla.mla_linears``' projections by the item each is
_ITEM = {"q_a": "mla.q_a", "q_b": "mla.q_b", "q": "mla.q_proj", "kv_a": "mla.kv_a",
         "kv_b": "mla.kv_b", "o": "mla.o_proj"}


def mla_matmul_shapes(spec: ModelSpec) -> list[tuple[str, int, int, int]]:
    """An MLA layer's projections in execution order as (item name, d_in, d_out, output
    width), whole (one rank's shard has the same weight shape on every rank of its group):
    the query's down and up projections (or one ``q_proj``), the key/value's down and up
    projections and the output projection (``mla.mla_linears``, registration order being
    execution order)."""
    return [(_ITEM[lin.name], lin.d_in, lin.d_out, lin.d_out) for lin in mla_linears(spec)]

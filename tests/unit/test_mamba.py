"""Granite 4.0-H's Mamba2 layers (memplan.hf.families_more.granitemoehybrid, memplan.model.
mamba, memplan.model.mamba_einsum): the count of a config without experts and the block's
saved bytes on both torch paths, by hand.

The traced ground truth (transformers' own GraniteMoeHybridForCausalLM cut to toy layers on its
torch path, stepped under the exact tracker, and its meta-device count) is
tests/traced/test_hf_heldout.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from memplan.model.dims import Dims, total
from memplan.model.layer import layer_blocks
from memplan.model.mamba import Mamba, mamba_terms
from memplan.parallel import ParallelConfig
from memplan.spec import ModelSpec, spec_from_hf_dict
from memplan.workload import MambaKernel, Workload

TINY_H = json.loads((Path(__file__).parent.parent / "data" / "hf" / "heldout" /
                     "granite-4.0-h-tiny" / "config.json").read_text())


def test_granite_4_h_without_experts_count_by_hand() -> None:
    """granite-4.0-h-tiny's config.json with num_local_experts 0 (its shared MLP alone):
    h = 1,536, 40 layers (attention on 5, 15, 25, 35; Mamba2 on the other 36), V = 100,352
    tied, 12 heads / 4 KV heads of 128, shared_intermediate_size 1,024; Mamba 48 heads of 64
    (d = 3,072), state 128, 1 group, conv 4 with bias, no projection bias
    (modeling_granitemoehybrid.py, transformers 5.3):

    embedding (tied)     100,352 * 1,536                              =   154,140,672
    attention            2 * 1,536^2 + 2 * 1,536 * 512                =     6,291,456
    Mamba2 (GraniteMoeHybridMambaLayer), conv channels 3,072 + 2 * 128 = 3,328:
      conv1d             3,328 * 4 + 3,328                            =        16,640
      in_proj            1,536 * (3,072 + 3,328 + 48)                 =     9,904,128
      dt_bias, A_log, D  3 * 48                                       =           144
      norm               3,072                                        =         3,072
      out_proj           3,072 * 1,536                                =     4,718,592
                                                                      =    14,642,576
    shared MLP           1,536 * 2,048 + 1,024 * 1,536                =     4,718,592
    two norms            2 * 1,536                                    =         3,072
    4 attention layers   4 * (6,291,456 + 4,718,592 + 3,072)          =    44,052,480
    36 Mamba layers      36 * (14,642,576 + 4,718,592 + 3,072)        =   697,112,640
    final norm           1,536                                        =         1,536
    total                                                             =   895,307,328

    (transformers 5.3 and 5.25 build the same count on the meta device:
    tests/traced/test_hf_heldout.py)."""
    spec = spec_from_hf_dict({**TINY_H, "num_local_experts": 0}, "config.json", "g")
    assert spec.approximate is None and spec.num_params == 895_307_328
    assert [i for i in range(40) if not spec.is_linear_layer(i)] == [5, 15, 25, 35]
    assert spec.mamba is not None and spec.mamba.inner == 3072 and spec.mamba.conv_dim == 3328


def _toy() -> ModelSpec:
    """h = 64, Mamba 4 heads of 16 (d = 64), state 8, 1 group, conv 4, chunks of 16."""
    return ModelSpec(name="toy", source="test", num_layers=2, hidden_size=64,
                     ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                     vocab_size=128, max_seq_len=64, norm="rmsnorm", mlp="swiglu",
                     position="none", tied_embeddings=True, fused_gate_up=True,
                     mamba={"num_heads": 4, "head_dim": 16, "state_size": 8, "num_groups": 1,
                            "conv_kernel": 4, "chunk_size": 16, "attention_layers": [1]})


def test_mamba_saved_bytes_by_hand() -> None:
    """Transformers 5.3's naive scan (``mamba_kernel`` torch). b = 2, s = 24 (T = 48; padded to N = 2 chunks of 16: S' = 32, Tp = 64), H = 4, P = 16,
    d = 64, n = 8, G = 1, C = 64 + 16 = 80 channels, K = 4; M = b N c^2 H = 2 * 2 * 256 * 4
    = 4,096; passed states b (N + 1) d n = 2 * 3 * 64 * 8 = 3,072. In fp32 (e = 4):

    in_proj's output   T (2 d + 2 G n + H) e = 48 * 148 * 4       =  28,416
    conv's output      b C (s + K - 1) e = 2 * 80 * 27 * 4         =  17,280
    x (silu's output)  T C 4 = 48 * 80 * 4                         =  15,360
    dt, three          3 T H e = 3 * 48 * 4 * 4                    =   2,304
    A, two             2 H 4                                       =      32
    x in chunks, two   2 Tp d 4 = 2 * 64 * 64 * 4                  =  32,768
    B, C, B * decay    3 Tp H n 4 = 3 * 64 * 4 * 8 * 4             =  24,576
    L, G, M            3 M 4                                       =  49,152
    two decays         2 Tp H 4                                    =   2,048
    states, two        2 * 3,072 * 4                               =  24,576
    chunks' decay      b (N + 1)^2 H 4 = 2 * 9 * 4 * 4             =     288
    masks              2 c^2 + 2 (N + 1)^2 = 512 + 18              =     530
    C_times_states.sum Tp d 4                                      =  16,384
    padded y           Tp d 4                                      =  16,384
    the norm's         (3 d + 1) T 4 = 193 * 48 * 4                =  37,056
    out_proj's input   T d e = 48 * 64 * 4                         =  12,288
    total                                                          = 279,442

    In bf16 (e = 2): in_proj's output 14,208, the conv's 8,640, dt 1,152, out_proj's input
    6,144 (the rest fp32), and x's and the gate's fp32 copies (T d 4 = 12,288 each) in place
    of silu's output: 279,442 - 14,208 - 8,640 - 1,152 - 6,144 - 15,360 + 24,576 =
    258,514."""
    spec = _toy()
    wl = Workload(micro_batch_size=2, seq_len=24, precision="fp32")
    dm = Dims.of(spec, ParallelConfig(), wl)
    torch = MambaKernel.TORCH
    assert total(mamba_terms(spec, dm, torch)) == 279_442
    bf16 = Workload(micro_batch_size=2, seq_len=24, precision="bf16-pure")
    assert total(mamba_terms(spec, Dims.of(spec, ParallelConfig(), bf16), torch)) == 258_514
    block = layer_blocks(spec, False, "linear")[1]
    assert isinstance(block, Mamba)
    # dt_bias, A_log, D; conv weight and bias; in_proj; the norm; out_proj
    assert block.tensor_sizes(spec, 1, 1) == [4, 4, 4, 320, 80, 64 * 148, 64, 64 * 64]


def test_einsum_scan_saved_bytes_by_hand() -> None:
    """Transformers 5.23's ``mamba2_chunk_scan`` (``mamba_kernel`` torch-einsum, the default),
    the toy and shapes above (Tp = 64, M = 4,096; S3 = b (N + 1) d n = 3,072, S2 = b N d n =
    2,048 elements). In fp32:

    in_proj's output, conv's, x (silu's output), dt (three), A  as above  =  63,392
    the padded x D multiplies   Tp d 4 = 64 * 64 * 4                    =  16,384
    masks                       2 c^2 + 2 (N + 1)^2                     =     530
    L, G, M                     3 M 4                                   =  49,152
    G's C and B, B, B_decay's and C_times_states' C copies
                                5 Tp H n 4 = 5 * 64 * 4 * 8 * 4         =  40,960
    x * dt, Y_diag's and the states' copies  2 Tp d 4                   =  32,768
    two decays                  2 Tp H 4                                =   2,048
    chunks' decay               b (N + 1)^2 H 4                         =     288
    the passed states' einsum's S3, C_times_states' S2   (3,072 + 2,048) * 4 = 20,480
    C_times_states              Tp d 4                                  =  16,384
    padded y                    Tp d 4                                  =  16,384
    the norm's                  (3 d + G) T 4 = 193 * 48 * 4            =  37,056
    out_proj's input            T d 4                                   =  12,288
    total                                                               = 308,114

    In bf16: in_proj's output 14,208, the conv's 8,640 and out_proj's input 6,144 (half of
    fp32's), x's fp32 copy T d 4 = 12,288 in place of silu's output (15,360) and the gate's
    fp32 copy (12,288); dt: the sum and softplus's output in bf16 (2 T H 2 = 768) and two fp32
    copies of the clamped dt (2 T H 4 = 1,536), 2,304 as in fp32: 308,114 - 14,208 - 8,640
    - 6,144 - 3,072 + 12,288 = 288,338."""
    spec = _toy()
    dm = Dims.of(spec, ParallelConfig(), Workload(micro_batch_size=2, seq_len=24,
                                                  precision="fp32"))
    assert total(mamba_terms(spec, dm, MambaKernel.TORCH_EINSUM)) == 308_114
    bf16 = Workload(micro_batch_size=2, seq_len=24, precision="bf16-pure")
    assert bf16.mamba_kernel is MambaKernel.TORCH_EINSUM
    assert total(mamba_terms(spec, Dims.of(spec, ParallelConfig(), bf16),
                             bf16.mamba_kernel)) == 288_338


def test_the_estimate_names_the_torch_path() -> None:
    from memplan.api import estimate

    est = estimate(_toy(), seq_len=32, micro_batch_size=1)
    assert any("mamba2_chunk_scan" in line and "5.23" in line for line in est.assumptions)
    old = estimate(_toy(), seq_len=32, micro_batch_size=1, mamba_kernel="torch")
    assert any("torch_forward" in line and "5.3" in line for line in old.assumptions)

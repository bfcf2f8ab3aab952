"""Qwen3-Next (memplan.hf.families_hybrid, memplan.model.deltanet): its parameter count, the
gated DeltaNet block's saved bytes and FLOPs, by hand.

The traced ground truth (transformers' own Qwen3NextForCausalLM stepped under the exact
tracker, and its meta-device count) is tests/traced/test_hf_qwen3_next.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.errors import MemplanError
from memplan.model.deltanet import DeltaNet, deltanet_terms, substitution_elements
from memplan.model.dims import Dims, total
from memplan.parallel import ParallelConfig
from memplan.spec import load_model, spec_from_hf_dict
from memplan.workload import Precision, Recompute, Workload

CONFIG = json.loads((Path(__file__).parent.parent / "data" / "hf" /
                     "Qwen3-Next-80B-A3B-Instruct" / "config.json").read_text())


def test_80b_a3b_count_by_hand() -> None:
    """Qwen/Qwen3-Next-80B-A3B-Instruct's config.json: h = 2048, 48 layers (every 4th full
    attention: 12 full, 36 linear), V = 151,936 untied, 16 heads / 2 KV heads of 256, linear
    attention 16 key / 32 value heads of 128, conv 4, 512 experts of 512, one shared expert of
    512 (modeling_qwen3_next.py, transformers 5.3):

    embedding and head     2 * 151,936 * 2,048                        =    622,329,856
    gated DeltaNet layer (Qwen3NextGatedDeltaNet.__init__):
      in_proj_qkvz         2,048 * (2 * 2,048 + 2 * 4,096)            =     25,165,824
      in_proj_ba           2,048 * 2 * 32                             =        131,072
      conv1d               (2 * 2,048 + 4,096) * 4                    =         32,768
      dt_bias, A_log       2 * 32                                     =             64
      norm                 128                                        =            128
      out_proj             4,096 * 2,048                              =      8,388,608
                                                                       =     33,718,464
    gated attention layer (Qwen3NextAttention.__init__):
      q_proj (with gate)   2,048 * 2 * 16 * 256                       =     16,777,216
      k_proj, v_proj       2 * 2,048 * 2 * 256                        =      2,097,152
      o_proj               16 * 256 * 2,048                           =      8,388,608
      q_norm, k_norm       2 * 256                                    =            512
                                                                       =     27,263,488
    MoE (Qwen3NextSparseMoeBlock), every layer:
      router               512 * 2,048                                =      1,048,576
      experts              512 * 3 * 2,048 * 512                      =  1,610,612,736
      shared expert        3 * 2,048 * 512                            =      3,145,728
      shared_expert_gate   2,048                                      =          2,048
                                                                       =  1,614,809,088
    two norms per layer    2 * 2,048                                  =          4,096
    36 linear layers       36 * (33,718,464 + 1,614,809,088 + 4,096)  = 59,347,139,328
    12 full layers         12 * (27,263,488 + 1,614,809,088 + 4,096)  = 19,704,920,064
    final norm             2,048                                      =          2,048
    total                                                             = 79,674,391,296

    Active per token: the top-10 of 512 experts, 502 * 3,145,728 * 48 = 75,799,461,888
    fewer: 3,874,929,408 (the card's "3B active")."""
    spec = spec_from_hf_dict(CONFIG, "config.json", "qwen3-next")
    assert spec.num_params == 79_674_391_296
    assert [spec.is_linear_layer(i) for i in range(8)] == [True, True, True, False] * 2
    assert load_model("qwen3-next-80b-a3b").num_params == 79_674_391_296
    expert = 3 * 2048 * 512
    assert spec.num_params - 48 * (512 - 10) * expert == 3_874_929_408


def test_other_layer_orders_are_refused() -> None:
    """Only a full layer every n-th is modelled (Qwen3NextConfig's own rule)."""
    data = dict(CONFIG, num_hidden_layers=4,
                layer_types=["full_attention", "linear_attention", "linear_attention",
                             "full_attention"])
    with pytest.raises(MemplanError, match="layer_types"):
        spec_from_hf_dict(data, "config.json", "q")
    every = dict(CONFIG, num_hidden_layers=4, layer_types=["linear_attention",
                                                            "full_attention"] * 2)
    spec = spec_from_hf_dict(every, "config.json", "q")
    assert spec.linear_attention is not None
    assert spec.linear_attention.full_attention_interval == 2


def test_substitution_loop_by_hand() -> None:
    """torch_chunk_gated_delta_rule's forward substitution, for i in 1..63: row (i) and sub
    (i x i) clones, both saved by their product: sum i = 2,016, sum i^2 = 63 * 64 * 127 / 6
    = 85,344; 87,360 elements per chunk and value head."""
    assert substitution_elements(64) == 2_016 + 85_344


TOY = dict(CONFIG, num_hidden_layers=2, hidden_size=128, intermediate_size=256,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
           shared_expert_intermediate_size=64, linear_num_key_heads=2,
           linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
           full_attention_interval=2)


def test_deltanet_saved_bytes_by_hand() -> None:
    """The toy's gated DeltaNet in fp32, b = 2, s = 128 (T = 256, two chunks of 64; Hk = 2,
    Hv = 4, dk = dv = 32, C = 2 * 64 + 128 = 256 channels, K = 4), in bytes:

    conv input T C 4 = 262,144; conv output 2 * 256 * 131 * 4 = 268,288; q and k repeated to
    4 heads 2 * 256 * 128 * 4 = 262,144; their rsqrt 2 * 256 * 4 * 4 = 8,192; sigmoid(b)
    4,096; softplus in and out 8,192                                      =   813,056
    rule: key, k_beta, k_beta exp(g), scaled query, k_cumdecay 5 * 131,072 and value,
    v_beta 2 * 131,072 = 917,504; masks 2 * 64 * 64 + 2 * 4 * 4 = 8,224; beta, exp(g)
    8,192; exp, tril, k_beta k^T, attn 4 * (2 * 4 * 2 * 4,096 * 4) = 1,048,576;
    substitution 2 * 4 * 2 * 87,360 * 4 = 5,591,040                       = 7,573,536
    per chunk: q k^T and its decayed copy 524,288; v_new 131,072; q exp(g) (second chunk)
    and the update's k exp(g_last - g) (first chunk) 2 * 2 * 4 * 64 * 32 * 4 = 131,072;
    exps (2 * 512 + 512 + 8) * 4 = 6,176; two states 2 * 2 * 4 * 32 * 32 * 4 = 65,536
                                                                          =   858,144
    gated norm: fp32 input 131,072, rsqrt 4,096, normed and weight * normed 262,144, gate
    and silu 262,144; out_proj's input 131,072                            =   790,528
    total                                                                 = 10,035,264

    ``torch.autograd.graph.saved_tensors_hooks`` counts 10,102,880 bytes saved by the
    module's forward (unique storages, parameters apart): the same plus the last chunk's
    state update (65,536 + 2,048 + 32 = 67,616), whose nodes no loss reaches and which are
    freed with the forward's output (tests/traced/test_hf_qwen3_next.py measures the step)."""
    spec = spec_from_hf_dict(TOY, "config.json", "toy")
    wl = Workload(micro_batch_size=2, seq_len=128, precision=Precision.FP32,
                  deltanet_kernel="torch")
    dm = Dims.of(spec, ParallelConfig(), wl)
    parts = [262_144, 268_288, 262_144, 8_192, 4_096, 8_192,
             917_504, 8_224, 8_192, 1_048_576, 5_591_040,
             524_288, 131_072 + 131_072, 6_176, 65_536,
             131_072, 4_096, 262_144, 262_144, 131_072]
    assert total(deltanet_terms(spec, wl, dm, Recompute.NONE)) == sum(parts) == 10_035_264


def test_deltanet_flops_by_hand() -> None:
    """Per token of a gated DeltaNet layer of the 80B (c = 64, dk = dv = 128, 32 value
    heads): projections 2 * (25,165,824 + 131,072 + 8,388,608) = 67,371,008; conv 2 * 8,192 *
    4 = 65,536; the chunked rule per head 2 * 64 * (3 * 128 + 2 * 128) = 81,920 within the
    chunk, 6 * 128 * 128 = 98,304 against the state, the substitution 2 * 85,344 / 64 =
    2,667 (exactly 2,667.0), 182,891 per head, 5,852,512 for 32 heads; total 73,289,056."""
    spec = load_model("qwen3-next-80b-a3b")
    assert DeltaNet().flops_per_token(spec, 4096) == 67_371_008 + 65_536 + 32 * 182_891


def test_checkpointed_rule_by_hand() -> None:
    """torch_chunk_gated_delta_rule without saving, b = Hk = Hv = 1, dk = dv = 2, chunks of
    c = 2, s = 4 (N = 2, Tp = 4), fp32: M = 1 * 2 * 2 * 2 * 4 = 32, one chunk's m = 16, its
    rows r = rk = 16, the state S = 16; the last row and sub-block clones b N ((c-1)^2 + c-1)
    = 2 * 2 * 4 = 16. Building attn: Tp (3 dk + 2 dv + 2) = 4 * 12 * 4 = 192 and 3 M = 96:
    288; the substitution: 192 + 2 M + b N (2 + 2) 4 = 192 + 64 + 32 = 288; the loop's start
    Tp (4 dk + 3 dv + 2) 4 = 256, 2 M, the clones and S: 352, its first product 2 m: 384;
    after the solved attn is freed (320) the state update m + 3 r + max(2 S + rk, 3 S) = 112
    is the largest of 3 m + 3 r = 96, m + 5 r = 96, m + 4 r + rk = 96: 432; the two c x c
    bool masks 8: 440."""
    from memplan.model.deltanet import Sizes, checkpointed_rule

    z = Sizes(b=1, s=4, hk=1, hv=1, dk=2, dv=2, taps=4, c=2, n=2)
    assert checkpointed_rule(z) == 440


def _fla_dims(**workload):
    spec = spec_from_hf_dict(TOY, "config.json", "toy")
    wl = Workload(micro_batch_size=2, seq_len=128, precision=Precision.BF16_PURE, **workload)
    return spec, wl, Dims.of(spec, ParallelConfig(), wl)


def test_fla_saved_bytes_by_hand() -> None:
    """The toy's gated DeltaNet on fla's kernels (the default), bf16, b = 2, s = 128: T = 256,
    Hk = 2, Hv = 4, dk = dv = 32, C = 256, chunks of 64 (N = 2), in bytes:

    causal_conv1d_fn's input x: T C 2 = 131,072; sigmoid(b) T Hv 2 = 2,048; softplus's fp32
    input and output 2 T Hv 4 = 8,192                                      =   141,312
    ChunkGatedDeltaRuleFunction.forward's saves: l2norm_fwd's q and k (the input's dtype)
    2 T Hv dk 2 = 131,072 and their fp32 rstd 2 T Hv 4 = 8,192; v's contiguous copy
    T Hv dv 2 = 65,536; g after chunk_local_cumsum (fp32) T Hv 4 = 4,096; A, zeros(B, T,
    Hv, 64) in k's dtype: T Hv 64 2 = 131,072                             =   339,968
    LayerNormGatedFunction: x (the rule's output) T Hv dv 2 = 65,536, the gate z 65,536,
    rstd T Hv 4 = 4,096; out_proj's input 65,536                          =   200,704
    total                                                                 =   681,984

    (the torch path saves 10,035,264 bytes in fp32 here: ``test_deltanet_saved_bytes_by_hand``)
    """
    spec, wl, dm = _fla_dims()
    assert wl.deltanet_kernel.value == "fla"
    parts = [131_072, 2_048, 8_192, 131_072, 8_192, 65_536, 4_096, 131_072,
             65_536, 65_536, 4_096, 65_536]
    assert total(deltanet_terms(spec, wl, dm, Recompute.NONE)) == sum(parts) == 681_984


def test_fla_moments_by_hand() -> None:
    """The same toy's forward at chunk_fwd_o and backward at prepare_wy_repr_bwd's end, bf16:

    beside the rule's saves (339,968 + 141,312 = 481,280): projected_states_qkvz
    T (2 * 2 * 32 + 2 * 4 * 32) 2 = 196,608 and _ba T 8 2 = 4,096; the conv's output T C 2
    = 131,072; z, b, a copies (Hv > Hk) T 4 (32 + 2) 2 = 69,632; g before the cumsum
    T 4 4 = 4,096; the q and k given 2 T 4 32 2 = 131,072, w and u, v_new and o T 4 (32 +
    3 * 32) 2 = 262,144 (with the q and k: T Hv (3 dk + 3 dv) 2 = 393,216); h b N Hv dk dv 2
    = 2 * 2 * 4 * 1,024 * 2 = 32,768; use_cache's fp32 final state b Hv dk dv 4 = 32,768:
    196,608 + 4,096 + 131,072 + 69,632 + 4,096 + 393,216 + 32,768 + 32,768 = 864,256.

    backward: T Hv (5 dk + 5 dv + 1) 2 = 256 * 4 * 321 * 2 = 657,408, h and dh 65,536, two
    fp32 gate gradients 2 T Hv 4 = 8,192: 731,136. Checkpointed: the rule's saves but the
    conv input and softplus (339,968 + 2,048 = 342,016) beside the same locals without the
    final state (831,488): 1,173,504."""
    from memplan.model.deltanet import DeltaNet

    spec, wl, dm = _fla_dims(kv_cache=True)  # the config's use_cache (the hf preset)
    block = DeltaNet()
    forward = block.forward_moments(spec, wl, dm, Recompute.NONE)[0]
    assert (forward.own_bytes, forward.transient_bytes) == (481_280, 864_256)
    backward = block.backward_moments(spec, wl, dm, Recompute.NONE)[1]
    assert (backward.own_bytes, backward.transient_bytes) == (481_280, 731_136)
    assert block.working_set(spec, wl, dm)[0].transient_bytes == 1_173_504


def test_solve_rule_saved_bytes_by_hand() -> None:
    """The toy's gated DeltaNet on transformers 5.17+'s rewritten torch rule (torch-solve,
    memplan.model.deltanet_solve) in fp32, b = 2, s = 128 (T = Tp = 256, N = 2 chunks of 64;
    Hk = 2, Hv = 4, dk = dv = 32; K = V = T Hv 32 * 4 = 131,072, G = T Hv 4 = 4,096, M =
    2 * 4 * 2 * 64 * 64 * 4 = 262,144), in bytes:

    conv input, conv output, q and k repeated (l2norm's x: the fp32 model's .to() aliases),
    their rsqrt, sigmoid(b), softplus: as the torch path                    =   813,056
    rule: padded query, key, value, k_beta, new_values, k_cumdecay 6 * 131,072 = 786,432;
    the scan's copies of a chunk of the decayed query (chunk 1) and key (chunk 0)
    2 * 2 * 4 * 64 * 32 * 4 = 131,072 (the layout copies: fp32, s a multiple of 64), the
    key's exp G and chunk_decay 2 * 4 * 2 * 4 = 64; the two chunk matmuls' operand copies
    4 K = 524,288                                                          = 1,445,952
    the mask 64 * 64 and -exp(A_log) 2 * 4 * 4                              =     4,128
    padded beta and exp(cum_decay) twice 3 G                                =    12,288
    pairwise_decay, k_beta k^T, ut_system, q k^T, intra_chunk_attn 5 M      = 1,310,720
    v_new of both chunks V and the two states 2 * 2 * 4 * 32 * 32 * 4      =   196,608
    gated norm and out_proj's input: as the torch path                      =   790,528
    total                                                                   = 4,573,280

    autograd's graph of ``torch_chunk_gated_delta_rule`` (transformers 5.25.0, this shape,
    unique storages of every node's saved tensors reachable from the output) holds
    3,240,008 bytes: the rule's part here (1,445,952 + 4,096 + 12,288 + 1,310,720 +
    196,608 = 2,969,664), l2norm's q and k and their rsqrt (262,144 + 8,192) and the 8-byte
    scaling scalar."""
    spec = spec_from_hf_dict(TOY, "config.json", "toy")
    wl = Workload(micro_batch_size=2, seq_len=128, precision=Precision.FP32,
                  deltanet_kernel="torch-solve")
    dm = Dims.of(spec, ParallelConfig(), wl)
    parts = [813_056, 1_445_952, 4_128, 12_288, 1_310_720, 196_608, 790_528]
    assert total(deltanet_terms(spec, wl, dm, Recompute.NONE)) == sum(parts) == 4_573_280


def test_solve_rule_bf16_has_no_layout_copies() -> None:
    """bf16, same toy: q and k are real fp32 copies (contiguous), so no operand copies and the
    decayed query and key are kept whole. Rule: 6 * 131,072 + 2 * 131,072 + 4,096 + 64 =
    1,052,736; mask 4,128; gates 12,288; 5 M 1,310,720; v_new and states 196,608: 2,576,480
    (autograd's graph: 2,846,792 = that - 32 + 262,144 + 8,192 + 8)."""
    from memplan.model import deltanet_solve as solve
    from memplan.model.deltanet import Sizes

    z = Sizes(b=2, s=128, hk=2, hv=4, dk=32, dv=32, taps=4, c=64, n=2)
    spec = spec_from_hf_dict(TOY, "config.json", "toy")
    wl = Workload(micro_batch_size=2, seq_len=128, precision=Precision.BF16_PURE,
                  deltanet_kernel="torch-solve")
    dm = Dims.of(spec, ParallelConfig(), wl)
    assert not solve.chunk_copies(z, dm) and not solve.slice_copies(z, dm)
    assert total(solve.solve_chunk_terms(z, dm) + solve.solve_per_chunk_terms(z)) == 2_576_480


def test_solve_checkpointed_rule_by_hand() -> None:
    """The torch-solve rule without saving, b = Hk = Hv = 1, dk = dv = 2, chunks of c = 2,
    s = 4 (N = 2, Tp = 4), fp32 (one head: no layout copies): K = V = 4 * 2 * 4 = 32,
    G = 16, M = 2 * 2 * 2 * 4 = 32, S = 16, r = rk = 16, the mask 4, chunk_decay 8. The scan's
    start 5 K + 4 V + 3 G + 3 M + S + 4 + 8 = 160 + 128 + 48 + 96 + 28 = 460; the most a
    chunk adds: 2 r + 3 S = 80 (over 4 r = 64 and 2 r + 2 S = 64): 540; building the chunk
    matrices 3 K + 2 V + 3 G + 4 + 3 M = 308."""
    from memplan.model.deltanet import Sizes
    from memplan.model.deltanet_solve import solve_checkpointed_rule

    class _Dims:
        e = 4

    z = Sizes(b=1, s=4, hk=1, hv=1, dk=2, dv=2, taps=4, c=2, n=2)
    assert solve_checkpointed_rule(z, _Dims()) == 540


def test_rerun_moments_of_the_wide_layer_by_hand() -> None:
    """Qwen3NextGatedDeltaNet's rerun under full recompute with the published head widths
    (Hk = 2, Hv = 4, dk = dv = 128, c = 64), b = 1; bytes alive beyond what the rule and the
    gated norm saved (traced on transformers 5.23, tests/traced/test_hf_qwen3_next.py).

    bf16, s = 192 (T = 192, rows = T Hv dv = 98,304), at the norm's last cast: the caller's
    locals the rule did not save: in_proj_qkvz's output T (2 * 2 * 128 + 2 * 4 * 128) * 2 =
    589,824, in_proj_ba's T * 8 * 2 = 3,072, z's copy rows * 2 = 196,608, b's and a's copies
    2 * 1,536, the conv's silu output T * 1,024 * 2 = 393,216 and g T * 4 * 4 = 3,072
    (1,188,864); the rule's bf16 output rows * 2 = 196,608, the norm's fp32 product
    rows * 4 = 393,216 and its variance T * 4 * 4 = 3,072: 1,781,760.

    fp32, s = 128 (T = 128, N = 2), at the last chunk's state update, beyond
    ``solve_rule_alive``: the decayed state and k^T @ v_new 2 * 4 * 128 * 128 * 4 =
    524,288, projected_states_ba T * 8 * 4 = 4,096, the silu output T * 1,024 * 4 =
    524,288, z's copy T * 512 * 4 = 262,144, b's and a's copies 2 * 2,048,
    inter_chunk_attn 4 * 64 * 128 * 4 = 131,072 and g T * 4 * 4 = 2,048: 1,452,032."""
    from memplan.model import deltanet_solve as solve
    from memplan.model.deltanet import Sizes, rerun_norm_working

    spec = spec_from_hf_dict(TOY, "config.json", "toy")
    bf16 = Dims.of(spec, ParallelConfig(), Workload(
        micro_batch_size=1, seq_len=192, precision=Precision.BF16_PURE))
    fp32 = Dims.of(spec, ParallelConfig(), Workload(
        micro_batch_size=1, seq_len=128, precision=Precision.FP32))
    wide = Sizes(b=1, s=192, hk=2, hv=4, dk=128, dv=128, taps=4, c=64, n=3)
    assert rerun_norm_working(wide, bf16, solved=True) == 1_781_760
    wide = wide._replace(s=128, n=2)
    assert solve.solve_update_locals(wide, fp32) == 1_452_032

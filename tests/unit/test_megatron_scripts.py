"""Megatron-LM's example launch scripts read as written (bash arrays, variables,
``${VAR:-default}``, line continuations, if/case branches), never run: the training command
each expands to, and the inputs or the refusal by name it gives. The scripts are verbatim
copies (tests/data/megatron/examples/README.md names their source and commit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.config_import import megatron, shell
from memplan.errors import MemplanError

EXAMPLES = Path(__file__).parent.parent / "data" / "megatron" / "examples"


def _command(name: str) -> list[str]:
    path = EXAMPLES / name
    words = shell.training_command(path.read_text(), name)
    assert words is not None
    return words


def _after(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


def test_every_example_expands_to_its_training_command() -> None:
    """All nine scripts give one command running a .py file (no error, nothing run)."""
    scripts = sorted(EXAMPLES.glob("*.sh"))
    assert len(scripts) == 9
    for path in scripts:
        words = shell.training_command(path.read_text(), path.name)
        assert words is not None and any(w.endswith(".py") for w in words), path.name


def test_gpt3_175b_arrays_and_variables() -> None:
    """train_gpt3_175b_distributed.sh: GPUS_PER_NODE=8 set in the script reaches the
    unquoted ${DISTRIBUTED_ARGS[@]}; $CHECKPOINT_PATH=$1 is empty (no arguments), so --save
    takes no value; the quoted --step-batch-size-schedule value is split again by the unquoted
    ${TRAINING_ARGS[@]}, as bash splits it."""
    words = _command("gpt3__train_gpt3_175b_distributed.sh")
    assert words[:3] == ["torchrun", "--nproc_per_node", "8"]
    at = words.index("--step-batch-size-schedule")
    assert words[at + 1:at + 4] == ["0:16", "2.4B:320", "4.8B:624"]
    assert _after(words, "--save") == "--load"


def test_gpt3_175b_inputs_by_hand() -> None:
    """GPT-3 175B, tp 8, pp 16, fp16, mbs 1, gbs 1536, seq 2048. Parameters by hand:
    per layer 12 h^2 + 13 h (qkv 3h^2+3h, proj h^2+h, fc1 4h^2+4h, fc2 4h^2+h, two
    LayerNorms 4h) at h = 12288: 1,811,989,504 + 159,744 = 1,812,149,248; 96 layers:
    173,966,327,808; final LayerNorm 2h = 24,576; position table 2048 h = 25,165,824; the
    tied vocabulary 50257 padded to a multiple of 128*8 = 1024 -> 51200, 51200 h =
    629,145,600; total 174,615,846,912."""
    imp = megatron.read(str(EXAMPLES / "gpt3__train_gpt3_175b_distributed.sh"), 128)
    assert imp.model.num_params == 174_615_846_912
    assert {k: imp.inputs[k] for k in ("tp", "pp", "micro_batch_size", "global_batch_size",
                                       "seq_len", "precision", "zero")} == {
        "tp": 8, "pp": 16, "micro_batch_size": 1, "global_batch_size": 1536,
        "seq_len": 2048, "precision": "fp16-mixed", "zero": 0}


def test_mixtral_needs_the_tokenizers_size() -> None:
    """train_mixtral_8x7b_distributed.sh: ${MASTER_ADDR:-"localhost"} defaults; the
    Llama2Tokenizer's vocabulary is in its files, so the reading asks for --vocab-size."""
    words = _command("mixtral__train_mixtral_8x7b_distributed.sh")
    assert _after(words, "--master_addr") == "localhost"
    assert _after(words, "--expert-model-parallel-size") == "8"
    with pytest.raises(MemplanError, match="--tokenizer-type"):
        megatron.read(str(EXAMPLES / "mixtral__train_mixtral_8x7b_distributed.sh"), 32)


def test_mixtral_inputs_by_hand(tmp_path: Path) -> None:
    """With the Llama-2 tokenizer's 32000 tokens appended (padded to a multiple of 128 ->
    32000): tp 1, pp 4, ep 8, ZeRO-1, 8 experts top-2, ffn 14336, GQA 8 groups."""
    script = tmp_path / "mixtral.sh"
    text = (EXAMPLES / "mixtral__train_mixtral_8x7b_distributed.sh").read_text()
    script.write_text(text.replace("--split 99990,8,2", "--split 99990,8,2 --vocab-size 32000"))
    imp = megatron.read(str(script), 32)
    spec = imp.model
    assert (spec.vocab_size, spec.num_kv_heads, spec.moe.num_experts, spec.moe.top_k,
            spec.moe.expert_ffn_hidden_size) == (32000, 8, 8, 2, 14336)
    assert {k: imp.inputs[k] for k in ("tp", "pp", "ep", "zero", "seq_len")} == {
        "tp": 1, "pp": 4, "ep": 8, "zero": 1, "seq_len": 4096}


def test_llama3_fp8_branch_taken() -> None:
    """train_llama3_8b_h100_fp8.sh sets DTYPE="fp8", so its `if [[ "$DTYPE" == "fp8" ]]`
    branch adds the fp8 flags (quoted "--fp8-format hybrid" items split by the unquoted
    expansion); TOKENIZER_ARG=${3:-"MOCK"} takes the mock-data branch, not the else; the
    script's `if [ ! -f ... ]` (a file test) is skipped. The fp8 flags read as Transformer
    Engine's delayed scaling (Megatron's default --fp8-recipe) with fp8 parameters and an
    amax history of 1024 rows."""
    words = _command("llama__train_llama3_8b_h100_fp8.sh")
    assert _after(words, "--fp8-format") == "hybrid"
    assert _after(words, "--vocab-size") == "128256" and "--mock-data" in words
    assert "--data-path" not in words
    assert _after(words, "--save") == "checkpoints/llama3_8b_fp8"
    imp = megatron.read(str(EXAMPLES / "llama__train_llama3_8b_h100_fp8.sh"), 8)
    assert {k: imp.inputs[k] for k in ("te_fp8", "te_fp8_param_gather",
                                       "te_fp8_amax_history_len")} == {
        "te_fp8": "delayed", "te_fp8_param_gather": True, "te_fp8_amax_history_len": 1024}


def test_gptoss_argument_loop_not_entered() -> None:
    """02_train.sh's `while [[ $# -gt 0 ]]` does not run with no arguments; PP_SIZE=
    ${WORLD_SIZE} = $(($GPUS_PER_NODE*$NUM_NODES)) = 8."""
    words = _command("gptoss__02_train.sh")
    assert _after(words, "--pipeline-model-parallel-size") == "8"
    assert _after(words, "--save") == "NO_VALUE_PROVIDED"


def test_megatron_fsdp_branch_appends_to_the_array() -> None:
    """train_llama3_8b_fsdp_h100_fp8.sh: USE_MEGATRON_FSDP=${USE_MEGATRON_FSDP:-1} takes
    the branch that rebuilds TRAINING_ARGS from "${TRAINING_ARGS[@]}" plus the FSDP flags;
    USE_UV=1 puts `uv run` before the launcher."""
    words = _command("megatron_fsdp__train_llama3_8b_fsdp_h100_fp8.sh")
    assert words[:2] == ["uv", "run"]
    assert _after(words, "--data-parallel-sharding-strategy") == "optim_grads_params"
    assert words.index("--bf16") < words.index("--use-megatron-fsdp")


@pytest.mark.parametrize(("name", "script"), [
    ("bert__train_bert_340m_distributed.sh", "pretrain_bert.py"),
    ("t5__train_t5_220m_distributed.sh", "pretrain_t5.py"),
    ("mamba__train.sh", "pretrain_hybrid.py")])
def test_other_models_refused_by_their_script(name: str, script: str) -> None:
    """BERT, T5 and the Mamba hybrid are not GPTModel: refused naming the script. mamba's
    `case "${MODEL_SCALE}"` takes the "800M" item (TENSOR_MODEL_PARALLEL_SIZE=1) and its
    options string (continuations inside quotes) splits into words."""
    if name == "mamba__train.sh":
        assert _after(_command(name), "--tensor-model-parallel-size") == "1"
        assert _after(_command(name), "--hidden-size") == "1024"
    with pytest.raises(MemplanError, match=script):
        megatron.read(str(EXAMPLES / name), 8)


def test_positional_arguments_missing_are_refused_by_flag() -> None:
    """finetune_gpt_distributed-1.3b.sh takes the global batch from $4: without it
    `--global-batch-size $bs` has no value, as Megatron's argparse would find."""
    words = _command("academic_paper_scripts__detxoify_lm__finetune_gpt_distributed-1.3b.sh")
    assert _after(words, "--nproc_per_node") == "16"
    with pytest.raises(MemplanError, match="--global-batch-size"):
        megatron.read(str(EXAMPLES / "academic_paper_scripts__detxoify_lm__"
                                     "finetune_gpt_distributed-1.3b.sh"), 16)


def test_undecided_branch_that_sets_a_variable_is_refused() -> None:
    """A variable set under a file test cannot be known without running the script."""
    text = 'if [ -f /etc/x ]; then TP=2; fi\ntorchrun pretrain_gpt.py --num-layers 2\n'
    with pytest.raises(MemplanError, match="TP is set in a branch"):
        shell.training_command(text, "t.sh")


def test_small_script_by_hand() -> None:
    """Quoted arrays keep their items whole, unquoted ones split; += appends; ${X-d} keeps
    an empty X; $((2*4)) is 8; `case` matches a glob."""
    text = ('TP=2; E=""\nA=( --tensor-model-parallel-size $TP )\nA+=( "--x ${E-d}" )\n'
            'case "$TP" in 1) PP=1 ;; [2-4]) PP=$((2*4)) ;; esac\n'
            'python pretrain_gpt.py "${A[@]}" --pipeline-model-parallel-size $PP \\\n'
            '  ${A[@]}\n')
    assert shell.training_command(text, "t.sh") == [
        "python", "pretrain_gpt.py", "--tensor-model-parallel-size", "2", "--x ",
        "--pipeline-model-parallel-size", "8", "--tensor-model-parallel-size", "2", "--x"]


def test_arithmetic_divides_as_bash() -> None:
    """bash's / and % truncate toward zero (C's): -7 / 2 is -3 and -7 % 2 is -1; 7 / -2 is -3
    and 7 % -2 is 1 (bash -c 'echo $((-7/2)) $((-7%2)) $((7/-2)) $((7%-2))')."""
    text = 'A=-7\npython pretrain_gpt.py $((A/2)) $((A%2)) $((7/-2)) $((7%-2))\n'
    assert shell.training_command(text, "t.sh") == ["python", "pretrain_gpt.py", "-3", "-1",
                                                    "-3", "1"]


def test_arithmetic_past_64_bits_is_left_as_text() -> None:
    """bash's integers are 64-bit: 3037000500 squared (9,223,372,037,000,250,000) is past
    2^63 - 1, so $((N*N)) is not evaluated (its text stays, and a flag reading it says it is
    no integer); a chain of such products never grows a number without bound."""
    text = 'N=3037000499\nM=$((N*N))\nN=3037000500\npython pretrain_gpt.py $M $((N*N))\n'
    assert shell.training_command(text, "t.sh") == [
        "python", "pretrain_gpt.py", "9223372030926249001", "$((N*N))"]


@pytest.mark.parametrize("text", [
    'A=( x )\n' + 'A=( "${A[@]}" "${A[@]}" )\n' * 40 + 'python pretrain_gpt.py\n',
    'X=ab\n' + 'X="$X$X"\n' * 60 + 'python pretrain_gpt.py $X\n',
    'python pretrain_gpt.py ' + '${A:-' * 5000 + 'x' + '}' * 5000 + '\n',
])
def test_scripts_that_grow_without_bound_are_refused(text: str) -> None:
    """Doubling an array or a string line after line, or defaults nested thousands deep:
    one line, before memory fills."""
    with pytest.raises(MemplanError) as err:
        shell.training_command(text, "t.sh")
    assert "\n" not in str(err.value)

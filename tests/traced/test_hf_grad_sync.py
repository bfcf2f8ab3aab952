"""hf's default gradient sync under accumulation, pinned in accelerate's and transformers' code.

The hf preset's ``grad_sync`` is ``last`` (``memplan.presets``): ``Trainer._inner_training_loop``
(transformers/trainer.py) runs each micro-batch of a step but the last under
``accelerator.no_sync(model)``, unless ``sync_each_batch`` is set or the run is DeepSpeed's;
``Accelerator.no_sync`` (accelerate/accelerator.py) is DDP's ``no_sync()`` or FSDP2's
``set_requires_gradient_sync(False)``. These tests run that code on CPU (one process: the
contexts are entered as on a data-parallel rank, which is what decides the bytes).

Versions: transformers 5.3.0, accelerate 1.15.0.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import GradientAccumulationPlugin  # noqa: E402


def test_sync_each_batch_is_off_by_default() -> None:
    """Neither accelerate's plugin nor Trainer's arguments turn the per-batch sync on."""
    assert GradientAccumulationPlugin(num_steps=4).sync_each_batch is False
    args = transformers.TrainingArguments(output_dir="/tmp/memplan-hf-sync", report_to=[])
    assert args.accelerator_config.gradient_accumulation_kwargs is None


def test_accumulate_syncs_only_the_last_micro_batch() -> None:
    """``Accelerator(gradient_accumulation_steps=3).accumulate``: ``sync_gradients`` is True
    at every third micro-batch only (``_do_sync``: step % num_steps == 0)."""
    acc = Accelerator(gradient_accumulation_steps=3, cpu=True)
    model = torch.nn.Linear(4, 4)
    seen = []
    for _ in range(6):
        with acc.accumulate(model):
            seen.append(acc.sync_gradients)
    assert seen == [False, False, True, False, False, True]


def test_fsdp2_no_sync_turns_the_gradient_sync_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FSDP2, ``Accelerator.no_sync`` is ``set_requires_gradient_sync(False)`` for the
    micro-batch, True again after it: the unsharded accumulation of ``grad_sync`` last."""
    monkeypatch.setattr(Accelerator, "is_fsdp2", property(lambda self: True))
    acc = Accelerator(cpu=True)

    class Model:
        calls: list[bool] = []

        def set_requires_gradient_sync(self, value: bool) -> None:
            self.calls.append(value)

    model = Model()
    with acc.no_sync(model):
        assert model.calls == [False]
    assert model.calls == [False, True]


def test_trainer_runs_all_but_the_last_micro_batch_without_sync(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Two steps of ``Trainer.train`` with 2 micro-batches each on a 1-layer GPT-2: the first
    micro-batch of each step runs under ``accelerator.no_sync``, the second syncs."""
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (4, 8))
    data = [{"input_ids": row, "labels": row} for row in ids]
    unsynced = [False]
    real = Accelerator.no_sync

    @contextlib.contextmanager
    def no_sync(self, model):
        unsynced[0] = True
        with real(self, model):
            yield
        unsynced[0] = False

    seen: list[bool] = []  # per micro-batch's forward: inside no_sync?
    monkeypatch.setattr(Accelerator, "no_sync", no_sync)
    model.register_forward_pre_hook(lambda module, args: seen.append(unsynced[0]))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=2,
        max_steps=2, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
        dataloader_num_workers=0)
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    assert seen == [True, False, True, False]

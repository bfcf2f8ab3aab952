"""torchtitan's own Llama 3 (``torchtitan.models.llama3.Llama3Model``) at toy width, built as
torchtitan builds its flavors: its blocks sit in an ``nn.ModuleDict`` (``layers["0"]``, ...).
Its init reads values (``trunc_normal_``): trace it with real tensors."""

import torch

from memplan.profile.frameworks import torchtitan_config

CONFIG = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=256)


def config(seq_len: int = 128):
    return torchtitan_config(**CONFIG, seq_len=seq_len)


def build(*, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.nn.Module:
    with torch.device(device):
        model = config().build()
    model.init_states(buffer_device=torch.device(device))
    for p in model.parameters():  # the weights only: RoPE's cache stays complex
        p.data = p.data.to(dtype)
    return model

"""A model type memplan has no reader for (memplan.hf.fallback), without transformers: one
line naming the type and how to count it. With transformers: tests/traced/
test_hf_moe_families.py."""

from __future__ import annotations

import pytest

from memplan.errors import MemplanError
from memplan.spec import spec_from_hf_dict

SMOL = {"model_type": "starcoder2", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100}


def test_without_transformers_one_line_names_the_type_and_the_way(monkeypatch) -> None:
    import memplan.profile.hf_meta as hf_meta

    def missing(data):
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(hf_meta, "meta_build", missing)
    with pytest.raises(MemplanError) as err:
        spec_from_hf_dict(SMOL, "cfg.json", "m")
    message = str(err.value)
    assert "\n" not in message and message.startswith("cfg.json: model_type:")
    assert "'starcoder2'" in message and "pip install transformers" in message


def test_transformers_build_keeps_third_party_logs_back(caplog) -> None:
    """The meta build's imports and construction log nothing below ERROR to the command's
    stream (torchao's unloaded CUDA extensions, torch's enum deprecation), and the logging
    level disabled before is the one after."""
    import logging

    from memplan.profile import hf_meta

    logging.disable(logging.NOTSET)
    with hf_meta._quiet():
        logging.getLogger("torchao").warning("held back")
        assert logging.root.manager.disable == logging.WARNING
    assert logging.root.manager.disable == logging.NOTSET
    assert "held back" not in caplog.text

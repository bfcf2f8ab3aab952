"""The GPU catalog: every entry loads, names and aliases resolve, memory is the usable figure.

``memory_bytes`` is what the device reports to the framework (``total_memory``), which is always
below the marketing size: an "80GB" H100 reports 79.19 GiB. The exact figures pinned here are the
ones recorded in ``model_specs/gpus.toml`` with their sources; change both together.
"""

from __future__ import annotations

import pytest

from memplan.errors import MemplanError
from memplan.hardware import GpuSpec, gpu_catalog, load_gpu

GIB = 2**30

EXPECTED = {
    "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200",
    "mi300x", "l40s", "rtx-4090", "v100-32gb",
    "rtx-3090", "rtx-5090", "a10g", "l4", "rtx-a6000",
}

# (floor, ceiling) in GiB for the reported figure; the ceiling is the marketing size read as GiB,
# which the reported figure never reaches.
REPORTED_GIB_RANGE = {
    "a100-40gb": (39, 40),
    "a100-80gb": (79, 80),
    "h100-sxm": (79, 80),
    "h100-pcie": (79, 80),
    "h200": (139, 141),
    "b200": (178, 180),
    "mi300x": (191, 192),
    "l40s": (44, 48),
    "rtx-4090": (23, 24),
    "v100-32gb": (31, 32),
    "rtx-3090": (23, 24),
    "rtx-5090": (31, 32),
    "a10g": (22, 24),
    "l4": (21, 24),
    "rtx-a6000": (47, 48),
}


def test_catalog_holds_the_expected_gpus():
    assert EXPECTED <= set(gpu_catalog())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_gpu_loads_by_its_canonical_name(name):
    gpu = load_gpu(name)
    assert isinstance(gpu, GpuSpec)
    assert gpu.name == name
    assert gpu.vendor in {"nvidia", "amd"}
    assert gpu.memory_source.strip() and gpu.source.strip()


def test_every_catalog_entry_loads():
    for key in gpu_catalog():
        assert load_gpu(key).name == key


def test_every_alias_resolves_to_its_own_gpu():
    # A duplicated alias would silently point at whichever entry came last.
    for key, gpu in gpu_catalog().items():
        for alias in gpu.aliases:
            assert load_gpu(alias).name == key, alias


@pytest.mark.parametrize(
    ("alias", "key"),
    [
        ("H100", "h100-sxm"),
        ("h100-80gb", "h100-sxm"),
        ("h100-sxm5", "h100-sxm"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),  # torch.cuda.get_device_name() spelling
        ("H100 PCIe", "h100-pcie"),
        ("a100", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("h200-sxm", "h200"),
        ("NVIDIA H200", "h200"),
        ("4090", "rtx-4090"),
        ("RTX_4090", "rtx-4090"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("AMD Instinct MI300X", "mi300x"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("L40S", "l40s"),
        ("B200", "b200"),
        ("NVIDIA GeForce RTX 3090", "rtx-3090"),
        ("NVIDIA GeForce RTX 5090", "rtx-5090"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA RTX A6000", "rtx-a6000"),
        ("A6000", "rtx-a6000"),
    ],
)
def test_aliases_and_device_names_resolve(alias, key):
    assert load_gpu(alias).name == key


@pytest.mark.parametrize("name", sorted(REPORTED_GIB_RANGE))
def test_memory_is_the_reported_figure_not_the_marketing_one(name):
    gpu = load_gpu(name)
    low, high = REPORTED_GIB_RANGE[name]
    assert type(gpu.memory_bytes) is int
    assert low * GIB < gpu.memory_bytes < high * GIB


def test_h100_memory_is_exact():
    # deviceQuery "81090 MBytes (85028896768 bytes)"; PyTorch OOM "total capacity of 79.19 GiB"
    assert load_gpu("h100-sxm").memory_bytes == 85_028_896_768
    assert round(load_gpu("h100").memory_bytes / GIB, 2) == 79.19
    assert load_gpu("h100-sxm").memory_bytes < 80 * GIB


def test_fine_tuning_gpus_memory_is_exact():
    """deviceQuery "24154 MBytes (25327697920 bytes)" (RTX 3090), "22478 MBytes (23570219008
    bytes)" (L4); torch repr total_memory=22587MB (A10G) and 48676MB (RTX A6000), in MiB; the
    RTX 5090's OOM message "total capacity of 31.36 GiB" -> 32112 MiB."""
    assert load_gpu("rtx-3090").memory_bytes == 25_327_697_920
    assert load_gpu("l4").memory_bytes == 23_570_219_008
    assert load_gpu("a10g").memory_bytes == 22_587 * 2**20
    assert load_gpu("rtx-a6000").memory_bytes == 48_676 * 2**20
    assert round(load_gpu("rtx-5090").memory_bytes / GIB, 2) == 31.36


def test_h200_memory_is_exact():
    # torch "total_memory=143156MB" (MiB); PyTorch OOM "total capacity of 139.80 GiB"
    assert load_gpu("h200").memory_bytes == 143_156 * 2**20 == 150_109_945_856
    assert round(load_gpu("h200").memory_bytes / GIB, 2) == 139.80


def test_rates_are_plausible():
    # from the slowest catalog GPU up: the A10G's 70 TFLOPS and the L4's 300 GB/s GDDR6
    for gpu in gpu_catalog().values():
        assert 5e13 <= gpu.bf16_flops <= 1e16, gpu.name
        assert 2.5e11 <= gpu.hbm_bytes_per_s <= 1e13, gpu.name
        assert 1e9 <= gpu.inter_node_bytes_per_s <= gpu.intra_node_bytes_per_s <= 1e12, gpu.name
        assert gpu.gpus_per_node >= 1


def test_dense_not_sparse_flops():
    # Datasheets headline the 2:4-sparse figure; the catalog holds the dense one.
    assert load_gpu("h100-sxm").bf16_flops == pytest.approx(989.4e12)
    assert load_gpu("a100-80gb").bf16_flops == pytest.approx(312e12)
    assert load_gpu("b200").bf16_flops == pytest.approx(2.25e15)


@pytest.mark.parametrize("name", ["h10", "h100-sxm4"])
def test_unknown_gpu_raises_with_a_suggestion(name):
    with pytest.raises(MemplanError, match="did you mean") as err:
        load_gpu(name)
    assert "h100" in str(err.value)
    assert name in str(err.value)


def test_unknown_gpu_without_near_names_still_raises():
    with pytest.raises(MemplanError, match="unknown GPU"):
        load_gpu("definitely-not-a-gpu")


def test_one_table_read_gives_the_whole_catalogs_gpu_for_every_name_and_alias():
    # load_gpu reads one GPU's table where the file keeps its flat form (hardware._sections);
    # the whole file through tomllib is the reference
    from memplan.hardware import _sections

    flat = _sections()
    assert flat is not None  # model_specs/gpus.toml is written in that form
    tables, index = flat
    names = {alias: key for key, gpu in gpu_catalog().items() for alias in (key, *gpu.aliases)}
    assert len(names) == 74 and set(tables) == set(gpu_catalog())
    for alias, key in names.items():
        assert index[alias] == key
        for spelling in (alias, alias.upper(), alias.replace("-", "_")):
            assert load_gpu(spelling) == gpu_catalog()[key]


def _catalog_at(monkeypatch, tmp_path, text):
    import memplan.hardware as hardware

    (tmp_path / "gpus.toml").write_text(text)
    monkeypatch.setattr(hardware, "data_dir", lambda: tmp_path)
    for cached in (hardware.gpu_catalog, hardware._alias_index, hardware._sections,
                   hardware._one):
        cached.cache_clear()
    return hardware


ENTRY = """compute_capability = "9.0"
vendor = "nvidia"
memory_bytes = 100
memory_source = "m"
bf16_flops = 1e15
hbm_bytes_per_s = 1e12
intra_node_bytes_per_s = 1e11
inter_node_bytes_per_s = 1e10
gpus_per_node = 8
host_link_bytes_per_s = 1e10
host_memory_bytes_per_s = 1e11
host_source = "h"
source = "s"
"""


@pytest.mark.parametrize("aliases", ['aliases = ["x-one", "x-1"]  # one line',
                                     '  aliases = [ "x-one","x-1", ]',
                                     'aliases = ["x-one", "x\\u002d1"]',
                                     'aliases = [\n  "x-one",\n  "x-1",\n]',
                                     'aliases = ["x-one", """x-1"""]'])
def test_a_catalog_in_another_form_is_read_whole(monkeypatch, tmp_path, aliases):
    # aliases across lines or a multi-line string: not the flat form, so the whole file is
    # parsed; indented lines and escaped aliases are read in that form; the same GPUs
    hardware = _catalog_at(monkeypatch, tmp_path,
                           f"# a catalog\n\n[gpu-a]\n{aliases}\n{ENTRY}\n[gpu-b]\n{ENTRY}")
    try:
        assert (hardware._sections() is None) == ("\n" in aliases or '"""' in aliases)
        assert hardware.load_gpu("X_ONE").name == "gpu-a"
        assert hardware.load_gpu("x-1").memory_bytes == 100
        assert hardware.load_gpu("gpu-b").name == "gpu-b"
        with pytest.raises(MemplanError, match="did you mean 'gpu-b' or 'gpu-a'"):
            hardware.load_gpu("gpu-c")
    finally:
        for cached in (hardware.gpu_catalog, hardware._alias_index, hardware._sections,
                       hardware._one):
            cached.cache_clear()

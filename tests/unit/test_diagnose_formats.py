"""PyTorch's out-of-memory messages and memory snapshots, read as PyTorch really writes them.

The messages below are copied as users pasted them in GitHub issues (line breaks, prefixes
and typos included); each cites its issue and the PyTorch version, as stated there or as the
format dates it (the format history is in ``memplan.diagnose.oom``'s docstring). Expected
bytes are worked out by hand from the printed sizes: round(value x unit), 2**10-based units.

The snapshot fixture mirrors the dict that ``THCPModule_memorySnapshot``
(pytorch/pytorch ``torch/csrc/cuda/Module.cpp``) builds and ``torch.cuda.memory._dump_snapshot``
pickles; ``torch/csrc/cuda/memory_snapshot.cpp`` writes the same keys from C++.
"""

from __future__ import annotations

import json
import os
import pickle
import random

import pytest

from memplan.cli import main
from memplan.diagnose import parse_oom
from memplan.diagnose.snapshot import load_snapshot, snapshot_report
from memplan.errors import MemplanError

KIB_BOUND, MIB_BOUND, GIB_BOUND = 6, 5_243, 5_368_710  # ceil(0.005 x unit)
MiB = 2**20


# --- format_size -------------------------------------------------------------------------

def format_size(size: int) -> str:
    """c10's format_size: ``std::fixed``, ``precision(2)``, thresholds ``<= 1024``,
    ``<= 1048576``, ``<= 1073741824ULL`` (checked in the 2.1.2 wheel's machine code)."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


def _message(req: int, total: int, free: int, alloc: int, unalloc: int) -> str:
    return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {format_size(req)}. "
            f"GPU 0 has a total capacity of {format_size(total)} of which {format_size(free)} "
            f"is free. Of the allocated memory {format_size(alloc)} is allocated by PyTorch, "
            f"and {format_size(unalloc)} is reserved by PyTorch but unallocated.")


def test_format_size_thresholds() -> None:
    assert [format_size(n) for n in (0, 1024, 1025, 1048576, 1048577, 2**30, 2**30 + 1,
                                     4 * 2**40)] == [
        "0 bytes", "1024 bytes", "1.00 KiB", "1024.00 KiB", "1.00 MiB", "1024.00 MiB",
        "1.00 GiB", "4096.00 GiB"]
    r = parse_oom(_message(1024, 2**30, 1048576, 1025, 0))
    assert (r.requested_bytes, r.total_bytes, r.free_bytes) == (1024, 2**30, 1048576)
    assert (r.allocated_bytes, r.reserved_bytes) == (1024, 1024)  # 1025 printed "1.00 KiB"


def test_every_printed_size_is_within_the_rounding_bound() -> None:
    rng = random.Random(7)
    edges = [u * k + d for u in (1024, MiB, 2**30) for k in (1, 2, 999, 1023, 1024)
             for d in (-1, 0, 1, 5, 511, 512, 513)]
    sizes = edges + [rng.randrange(0, 200 * 2**30) for _ in range(3000)]
    def bound(size: int) -> int:  # of the unit format_size picks for size
        unit = format_size(size).split()[1]
        return {"bytes": 0, "KiB": KIB_BOUND, "MiB": MIB_BOUND, "GiB": GIB_BOUND}[unit]

    for a, b in zip(sizes, reversed(sizes)):
        r = parse_oom(_message(a, b, a, b, a))
        for true, got in ((a, r.requested_bytes), (b, r.total_bytes), (a, r.free_bytes),
                          (b, r.allocated_bytes)):
            assert abs(got - true) <= bound(true) <= r.rounding_bytes, (true, got)
        assert abs(r.reserved_bytes - (a + b)) <= bound(a) + bound(b) <= r.rounding_bytes


# --- real messages -----------------------------------------------------------------------

def _case(text: str, **expected: object) -> tuple[str, dict]:
    return text, expected


REAL = [
    # pytorch/pytorch#16417 (issue title; version not stated): "cached", which the
    # 1.3.1 wheel still prints and 1.4.0 no longer
    _case("RuntimeError: CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 10.92 GiB total "
          "capacity; 8.57 MiB already allocated; 9.28 GiB free; 4.68 MiB cached)",
          version="1.x-2.0", device=0, requested_bytes=13_107_200,
          total_bytes=11_725_260_718, allocated_bytes=8_986_296, free_bytes=9_964_324_127,
          reserved_bytes=4_907_336, allowed_bytes=None, rounding_bytes=GIB_BOUND),
    # shllln/GenerativeGraph#5 (2019-03, "cached": 1.3 or older): "1024.00 KiB", format_size
    # prints KiB up to 1 MiB
    _case("RuntimeError: CUDA out of memory. Tried to allocate 1024.00 KiB (GPU 0; 11.17 GiB total "
          "capacity; 10.90 GiB already allocated; 576.00 KiB free; 30.96 MiB cached)",
          version="1.x-2.0", requested_bytes=1_048_576, total_bytes=11_993_696_174,
          allocated_bytes=11_703_785_882, free_bytes=589_824, reserved_bytes=32_463_913,
          rounding_bytes=GIB_BOUND),
    # pytorch/pytorch#18853 (a traceback in a comment, "cached"): "1024.00 MiB", MiB up to 1 GiB
    _case("""    result = _VF.threshold(input, threshold, value)
RuntimeError: CUDA out of memory. Tried to allocate 1024.00 MiB (GPU 0; 15.90 GiB total capacity; 14.25 GiB already allocated; 991.56 MiB free; 607.00 KiB cached)

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "memtestcase.py", line 155, in <module>
    main()""",
          version="1.x-2.0", requested_bytes=1_073_741_824, total_bytes=17_072_495_002,
          allocated_bytes=15_300_820_992, free_bytes=1_039_726_019, reserved_bytes=621_568),
    # pytorch/pytorch#32101 (2020-01; version not stated): "reserved in total by PyTorch",
    # which the 1.4.0 wheel prints
    _case("RuntimeError: CUDA out of memory. Tried to allocate 152.00 MiB (GPU 0; 31.72 GiB total "
          "capacity; 24.89 GiB already allocated; 6.12 MiB free; 30.70 GiB reserved in total by "
          "PyTorch)",
          requested_bytes=159_383_552, total_bytes=34_059_090_657,
          allocated_bytes=26_725_433_999, free_bytes=6_417_285, reserved_bytes=32_963_873_997,
          non_pytorch_bytes=34_059_090_657 - 6_417_285 - 32_963_873_997),
    # PeterL1n/BackgroundMattingV2#142 (2021-07): a 1 GiB GPU is "1024.00 MiB"; "0 bytes"
    _case("RuntimeError: CUDA out of memory. Tried to allocate 72.00 MiB (GPU 0; 1024.00 MiB total "
          "capacity; 378.05 MiB already allocated; 0 bytes free; 418.00 MiB reserved in total by "
          "PyTorch)",
          requested_bytes=75_497_472, total_bytes=1_073_741_824, allocated_bytes=396_414_157,
          free_bytes=0, reserved_bytes=438_304_768, rounding_bytes=MIB_BOUND),
    # pytorch/pytorch#67971 (2021-11): the repro's torch.rand(10000) is 40,000 bytes, yet
    # "Tried to allocate 2.00 MiB": the small-pool segment (kSmallBuffer), not the tensor
    _case("> RuntimeError: CUDA out of memory. Tried to allocate 2.00 MiB (GPU 0; 6.00 GiB total "
          "capacity; 4.88 GiB already allocated; 0 bytes free; 4.96 GiB reserved in total by "
          "PyTorch)",
          requested_bytes=2 * MiB, total_bytes=6_442_450_944, allocated_bytes=5_239_860_101,
          free_bytes=0, reserved_bytes=5_325_759_447),
    # Li-Chongyi/Zero-DCE#52 (2023-06): OutOfMemoryError and the max_split_size_mb advice,
    # as the 1.13.1 and 2.0.1 wheels print them
    _case("OutOfMemoryError: CUDA out of memory. Tried to allocate 1.71 GiB (GPU 0; 6.00 GiB total "
          "capacity; 3.49 GiB already allocated; 1.04 GiB free; 3.50 GiB reserved in total by "
          "PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to "
          "avoid fragmentation.  See documentation for Memory Management and "
          "PYTORCH_CUDA_ALLOC_CONF",
          requested_bytes=1_836_098_519, total_bytes=6_442_450_944,
          allocated_bytes=3_747_358_966, free_bytes=1_116_691_497,
          reserved_bytes=3_758_096_384),
    # singhsourabh/Resume-NER#4 (2022-03): pasted without the closing parenthesis
    _case("RuntimeError: CUDA out of memory. Tried to allocate 92.00 MiB (GPU 0; 1.96 GiB total "
          "capacity; 1.46 GiB already allocated; 16.38 MiB free; 1.51 GiB reserved in total by "
          "PyTorch",
          requested_bytes=96_468_992, total_bytes=2_104_533_975,
          allocated_bytes=1_567_663_063, free_bytes=17_175_675,
          reserved_bytes=1_621_350_154),
    # intel/intel-extension-for-pytorch#629 (2024-05): IPEX's XPU allocator, no "free" part
    _case("RuntimeError: XPU out of memory. Tried to allocate 1.00 GiB (GPU 0; 15.56 GiB total "
          "capacity; 990.00 MiB already allocated; 990.00 MiB reserved in total by PyTorch)",
          version="1.x-2.0", requested_bytes=1_073_741_824, total_bytes=16_707_422_781,
          allocated_bytes=1_038_090_240, free_bytes=None, reserved_bytes=1_038_090_240,
          non_pytorch_bytes=None),
    # pytorch/pytorch#99699 (PR description, 2023-04): the sentence format as first printed
    # (main before 2.1), wrapped by its author; "capacty", NVML process sentences
    _case("""torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 138.00 MiB.
GPU 0 has a total capacty of 15.90 GiB of which 8.44 MiB is free.
Process 1246069 has 577.00 MiB memory in use. Including non-PyTorch memory,
this process has 15.32 GiB memory in use. Of the allocated memory
14.12 GiB is allocated by PyTorch, and 410.41 MiB is reserved
by PyTorch but unallocated. If reserved but unallocated memory is large
try setting max_split_size_mb to avoid fragmentation.  See documentation
 for Memory Management and PYTORCH_CUDA_ALLOC_CONF""",
          version="2.1+", device=0, requested_bytes=144_703_488, total_bytes=17_072_495_002,
          free_bytes=8_849_981, other_processes_bytes=605_028_352,
          process_bytes=16_449_724_744, allocated_bytes=15_161_234_555,
          reserved_bytes=15_161_234_555 + 430_346_076,
          non_pytorch_bytes=16_449_724_744 - (15_161_234_555 + 430_346_076),
          rounding_bytes=GIB_BOUND + MIB_BOUND),
    # chatchat-space/Langchain-Chatchat#3992 (2024-05, a log line): "capacty", so 2.1; another
    # process
    _case("2024-05-11 02:24:26,980 - es_kb_service.py[line:147] - ERROR: Error 发生 : CUDA out of "
          "memory. Tried to allocate 128.00 GiB. GPU 0 has a total capacty of 23.65 GiB of which "
          "7.95 GiB is free. Process 1957120 has 7.10 GiB memory in use. Including non-PyTorch "
          "memory, this process has 8.58 GiB memory in use. Of the allocated memory 8.13 GiB is "
          "allocated by PyTorch, and 8.94 MiB is reserved by PyTorch but unallocated. If reserved "
          "but unallocated memory is large try setting max_split_size_mb to avoid fragmentation.  "
          "See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
          requested_bytes=137_438_953_472, total_bytes=25_393_994_138, free_bytes=8_536_247_501,
          other_processes_bytes=7_623_566_950, process_bytes=9_212_704_850,
          allocated_bytes=8_729_521_029, reserved_bytes=8_729_521_029 + 9_374_269),
    # richard-peng-xia/MMed-RAG#38 (2025-05): "capacty", so 2.1; more allocated than the GPU
    # has, no NVML sentences
    _case("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has "
          "a total capacty of 8.00 GiB of which 0 bytes is free. Of the allocated memory 22.44 GiB "
          "is allocated by PyTorch, and 3.16 MiB is reserved by PyTorch but unallocated. If "
          "reserved but unallocated memory is large try setting max_split_size_mb to avoid "
          "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
          requested_bytes=67_108_864, total_bytes=8_589_934_592, free_bytes=0,
          allocated_bytes=24_094_766_531, reserved_bytes=24_094_766_531 + 3_313_500,
          process_bytes=None, non_pytorch_bytes=0),
    # pytorch/pytorch#16417 (comment, 2024-03): 2.2 ("capacity", expandable_segments advice,
    # torch.cuda.OutOfMemoryError, and GPU 0 printed, which 2.3 cannot)
    _case("""```
torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 has a total capacity of 23.65 GiB of which 11.06 MiB is free. Including non-PyTorch memory, this process has 23.60 GiB memory in use. Of the allocated memory 22.90 GiB is allocated by PyTorch, and 194.87 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
```""",
          requested_bytes=23_068_672, total_bytes=25_393_994_138, free_bytes=11_597_251,
          process_bytes=25_340_307_046, allocated_bytes=24_588_687_770,
          reserved_bytes=24_588_687_770 + 204_336_005, other_processes_bytes=0),
    # FireRedTeam/FireRedTTS2#17 (2025-09): torch.OutOfMemoryError, so 2.4 or later; two other
    # processes
    _case("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 26.00 MiB. GPU 0 has a "
          "total capacity of 11.66 GiB of which 9.81 MiB is free. Process 3893521 has 618.00 MiB "
          "memory in use. Process 1493972 has 1.28 GiB memory in use. Including non-PyTorch "
          "memory, this process has 9.74 GiB memory in use. Of the allocated memory 9.30 GiB is "
          "allocated by PyTorch, and 163.19 MiB is reserved by PyTorch but unallocated. If "
          "reserved but unallocated memory is large try setting "
          "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
          "documentation for Memory Management  "
          "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
          requested_bytes=27_262_976, total_bytes=12_519_829_668, free_bytes=10_286_531,
          other_processes_bytes=648_019_968 + 1_374_389_535, process_bytes=10_458_245_366,
          allocated_bytes=9_985_798_963, reserved_bytes=9_985_798_963 + 171_117_117,
          private_pool_bytes=None),
    # huggingface/trl#3436: torch.OutOfMemoryError, so 2.4 or later; the message line
    # carries no rank prefix, the traceback after it does
    _case("""torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 388.00 MiB. GPU 0 has a total capacity of 9.68 GiB of which 95.75 MiB is free. Including non-PyTorch memory, this process has 9.54 GiB memory in use. Of the allocated memory 6.61 GiB is allocated by PyTorch, and 2.57 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
[rank0]: Traceback (most recent call last):
[rank0]:   File "/data/cy/LLMlable/grpo/sft/sft.py", line 67, in <module>
[rank0]:     trainer.train()""",
          rank=None, requested_bytes=406_847_488, total_bytes=10_393_820_856,
          free_bytes=100_401_152, process_bytes=10_243_497_001, allocated_bytes=7_097_433_457,
          reserved_bytes=7_097_433_457 + 2_759_516_488, rounding_bytes=2 * GIB_BOUND),
    # ROCm/TheRock#2118 (2025-11, PyTorch 2.9 on ROCm, a CI log line): HIP, the memory
    # fraction after the (absent) process sentences, CUDA-graph private pools
    _case("2025-11-12T11:25:13.4961658Z FAILED [0.0005s] "
          "external-builds/pytorch/pytorch/test/test_autograd.py::TestAutogradDeviceTypeCUDA::"
          "test_inplace_on_view_multi_output_safe_cuda "
          "- torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 MiB. GPU 0 has a "
          "total capacity of 255.98 GiB of which 244.65 GiB is free. 1.05 GiB allowed; Of the "
          "allocated memory 1017.01 MiB is allocated by PyTorch, with 17.00 MiB allocated in "
          "private pools (e.g., HIP Graphs), and 54.99 MiB is reserved by PyTorch but unallocated. "
          "If reserved but unallocated memory is large try setting "
          "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
          "documentation for Memory Management  "
          "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
          version="2.1+", requested_bytes=2 * MiB, total_bytes=274_856_432_108,
          free_bytes=262_690_937_242, allowed_bytes=1_127_428_915,
          allocated_bytes=1_066_412_278, private_pool_bytes=17_825_792,
          reserved_bytes=1_066_412_278 + 57_661_194, process_bytes=None,
          rounding_bytes=GIB_BOUND),
    # intel/intel-extension-for-pytorch#851 (2025-08, torch 2.8.0+xpu): XPU, no "of which"
    _case("torch.OutOfMemoryError: XPU out of memory. Tried to allocate 4.00 GiB. GPU 0 has a "
          "total capacity of 13.74 GiB. Of the allocated memory 10.10 GiB is allocated by PyTorch, "
          "and 3.47 GiB is reserved by PyTorch but unallocated. Please use `empty_cache` to "
          "release all unoccupied cached memory.",
          version="2.1+", requested_bytes=4 * 2**30, total_bytes=14_753_212_662,
          free_bytes=None, allocated_bytes=10_844_792_422,
          reserved_bytes=10_844_792_422 + 3_725_884_129, non_pytorch_bytes=None,
          rounding_bytes=2 * GIB_BOUND),
    # intel/torch-xpu-ops#3011 (2026-03, PyTorch 2.12): XPU with "of which ... is free"
    _case("torch.OutOfMemoryError: XPU out of memory. Tried to allocate 4.66 GiB. GPU 0 has a "
          "total capacity of 5.65 GiB of which 5.65 GiB is free. Of the allocated memory 195.50 "
          "KiB is allocated by PyTorch, and 1.81 MiB is reserved by PyTorch but unallocated. "
          "Please use `empty_cache` to release all unoccupied cached memory.",
          requested_bytes=5_003_636_900, total_bytes=6_066_641_306, free_bytes=6_066_641_306,
          allocated_bytes=200_192, reserved_bytes=200_192 + 1_897_923,
          rounding_bytes=GIB_BOUND),
    # EvilBT/ComfyUI_SLK_joy_caption_two#28 (2024-10): the cudaMallocAsync backend (columns
    # collapsed by the rendering); no memory fraction set, so the limit is UINT64_MAX
    _case("""Allocation on device 0 would exceed allowed memory. (out of memory)
Currently allocated : 15.16 GiB
Requested : 512.00 KiB
Device limit : 15.99 GiB
Free (according to CUDA): 0 bytes
PyTorch limit (set by user-supplied memory fraction)
: 17179869184.00 GiB""",
          kind="allocator", version="cudaMallocAsync", device=0, requested_bytes=524_288,
          allocated_bytes=16_277_926_052, total_bytes=17_169_131_766, free_bytes=0,
          allowed_bytes=None, reserved_bytes=None, rounding_bytes=GIB_BOUND),
]


@pytest.mark.parametrize("text, expected", REAL, ids=[str(i) for i in range(len(REAL))])
def test_real_message(text: str, expected: dict) -> None:
    r, expected = parse_oom(text), dict(expected)
    assert r.kind == expected.pop("kind", "allocator")
    for name, value in expected.items():
        assert getattr(r, name) == value, name


# pytorch/pytorch#126766 (PyTorch 2.3.0), fudan-generative-vision/hallo#143 (issue title,
# 2024-07, torch.cuda.OutOfMemoryError): 2.3's GPU 0 NUL byte ends the message;
# Comfy-Org/ComfyUI#4934 (2024-09): the same for the cudaMallocAsync backend
TRUNCATED = [
    ("OutOfMemoryError: CUDA out of memory. Tried to allocate 3725.29 GiB. GPU", "PyTorch 2.3"),
    ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 192.00 MiB. GPU",
     "PyTorch 2.3"),
    (("torch.OutOfMemoryError: Allocation on device \n\n2024-09-15 22:48:26,085 - root - "
      "ERROR - Got an OOM, unloading all loaded models."), "cudaMallocAsync"),
]


@pytest.mark.parametrize("text, says", TRUNCATED)
def test_real_truncated_messages(text: str, says: str) -> None:
    with pytest.raises(MemplanError, match=says):
        parse_oom(text)


def test_real_message_cut_anywhere_raises_only_memplan_error() -> None:
    """Every prefix of every real message parses or raises MemplanError, nothing else."""
    for text, _ in REAL + TRUNCATED:
        for end in range(len(text) + 1):
            try:
                parse_oom(text[:end])
            except MemplanError:
                pass


# --- formats no issue showed -------------------------------------------------------------

TAIL = (" has a total capacity of 79.10 GiB of which 1.50 GiB is free. Of the allocated memory "
        "70.00 GiB is allocated by PyTorch, and 2.00 GiB is reserved by PyTorch but "
        "unallocated.")


@pytest.mark.parametrize("byte, device", [("\x03", 3), ("\x00", 0), ("\x0a", None)])
def test_pytorch_2_3_device_byte(byte: str, device: int | None) -> None:
    """2.3 streams the int8_t device index as a character; a C++ log keeps even the NUL, and
    a whitespace byte (GPU 10 is a newline) leaves no index to read."""
    r = parse_oom("CUDA out of memory. Tried to allocate 2.00 GiB. GPU " + byte + TAIL)
    assert (r.device, r.allocated_bytes) == (device, 70 * 2**30)


def test_pytorch_2_5_allowed_after_process_sentences() -> None:
    r = parse_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU "
                  "1 has a total capacity of 79.10 GiB of which 3.00 GiB is free. Process 7 has "
                  "17179869184.00 GiB memory in use. Including non-PyTorch memory, this "
                  "process has 76.00 GiB memory in use. 40.00 GiB allowed; Of the allocated "
                  "memory 39.00 GiB is allocated by PyTorch, with 1.00 GiB allocated in private "
                  "pools (e.g., CUDA Graphs), and 1.00 GiB is reserved by PyTorch but "
                  "unallocated.")
    assert (r.device, r.allowed_bytes, r.private_pool_bytes) == (1, 40 * 2**30, 2**30)
    # NVML's "not available" (2**64 - 1) is no process size
    assert (r.process_bytes, r.other_processes_bytes) == (76 * 2**30, 0)


def test_cuda_malloc_async_with_a_fraction_and_aligned_columns() -> None:
    r = parse_oom("torch.OutOfMemoryError: Allocation on device 1 would exceed allowed memory. "
                  "(out of memory)\nCurrently allocated     : 30.00 GiB\nRequested               "
                  ": 2.00 GiB\nDevice limit            : 79.10 GiB\nFree (according to CUDA): "
                  "40.00 GiB\nPyTorch limit (set by user-supplied memory fraction)\n"
                  "                        : 31.64 GiB")
    assert (r.device, r.requested_bytes, r.allowed_bytes) == (1, 2 * 2**30, 33_973_191_311)


@pytest.mark.parametrize("text, says", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate more than 1EB memory.",
     "over 1 EB"),
    ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 12 has a total capacity of 79 GiB",
     "incomplete"),
    ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0" + TAIL.replace("70.00", "70,00"),
     "incomplete"),
    ("\x00\x01\x02 garbage \udcff", "no PyTorch out-of-memory message"),
])
def test_malformed(text: str, says: str) -> None:
    with pytest.raises(MemplanError, match=says):
        parse_oom(text)


def test_not_text() -> None:
    with pytest.raises(MemplanError, match="must be a string"):
        parse_oom(b"CUDA out of memory")  # type: ignore[arg-type]


# --- snapshots ---------------------------------------------------------------------------

def _frames(line: int) -> list[dict]:
    return [{"filename": "/workspace/train.py", "line": line, "name": "forward"}]


def _segment(device: int, address: int, blocks: list[tuple[int, int, str]], *,
             large: bool = True, pool: tuple[int, int] = (0, 0),
             expandable: bool = False) -> dict:
    """One segment dict, keys in THCPModule_memorySnapshot's order; sizes from its blocks as
    CUDACachingAllocator's snapshot() sums them."""
    out, addr = [], address
    for size, requested, state in blocks:
        out.append({"address": addr, "size": size, "requested_size": requested,
                    "state": state, "frames": _frames(addr % 97) if requested else []})
        addr += size
    active = [b for b in out if b["state"] != "inactive"]
    return {"device": device, "address": address,
            "total_size": sum(b["size"] for b in out),
            "allocated_size": sum(b["size"] for b in out if b["state"] == "active_allocated"),
            "active_size": sum(b["size"] for b in active),
            "requested_size": sum(b["requested_size"] for b in active),
            "stream": 0, "segment_type": "large" if large else "small",
            "segment_pool_id": pool, "is_expandable": expandable, "frames": [], "blocks": out}


def _event(action: str, addr: int, size: int, time_us: int) -> dict:
    key = "device_free" if action == "oom" else "addr"
    return {"action": action, key: addr, "size": size, "stream": 0, "time_us": time_us}


def writer_snapshot() -> dict:
    base0, base1 = 0x7F5A00000000, 0x7F6C00000000
    return {
        "segments": [
            _segment(0, base0, [(12 * MiB, 12 * MiB - 100, "active_allocated"),
                                (6 * MiB, 6 * MiB, "active_pending_free"),
                                (2 * MiB, 0, "inactive")]),
            _segment(0, base0 + 20 * MiB, [(512, 400, "active_allocated"),
                                           (2 * MiB - 512, 0, "inactive")], large=False),
            _segment(1, base1, [(40 * MiB, 40 * MiB, "active_allocated"),
                                (24 * MiB, 0, "inactive")], expandable=True),
            _segment(1, base1 + 2**36, [(8 * MiB, 0, "inactive")], pool=(1, 0)),
        ],
        "device_traces": [
            [_event("segment_alloc", base0, 20 * MiB, 10), _event("alloc", base0, 12 * MiB, 11),
             _event("free_requested", base0 + 12 * MiB, 6 * MiB, 12),
             _event("oom", 1024, 7 * MiB, 100)],
            [_event("segment_map", base1, 64 * MiB, 20), _event("alloc", base1, 40 * MiB, 21),
             _event("oom", MiB, 30 * MiB, 200), _event("snapshot", 0, 40 * MiB, 201)],
        ],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                               "max_split_size": -1, "garbage_collection_threshold": 0.0,
                               "expandable_segments": True, "pinned_num_register_threads": 1,
                               "release_lock_on_cudamalloc": False,
                               "pinned_use_cuda_host_register": False,
                               "roundup_power2_divisions": {"1": 0, "2": 0}},
        "external_annotations": [],
    }


# _dump_snapshot's pickle.dump (default protocol); memory_snapshot.cpp's TorchScript pickler
# writes protocol 2
@pytest.mark.parametrize("protocol", [pickle.DEFAULT_PROTOCOL, 2])
def test_writer_snapshot(tmp_path, protocol: int) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(writer_snapshot(), protocol=protocol))
    data = load_snapshot(str(path), trust_pickle=True)
    r = snapshot_report(data)  # the device of the latest "oom" event
    assert (r.kind, r.device, r.num_segments) == ("snapshot", 1, 2)
    assert (r.reserved_bytes, r.allocated_bytes) == (72 * MiB, 40 * MiB)
    assert (r.requested_bytes, r.free_bytes, r.largest_free_block_bytes) == (
        30 * MiB, MiB, 24 * MiB)
    r0 = snapshot_report(data, device=0)
    assert (r0.reserved_bytes, r0.allocated_bytes) == (22 * MiB, 12 * MiB + 512)
    # the 6 MiB pending free waits on another stream: not a free block
    assert (r0.largest_free_block_bytes, r0.requested_bytes, r0.free_bytes) == (
        2 * MiB, 7 * MiB, 1024)
    assert snapshot_report(data, device=5).num_segments == 0


def test_snapshot_through_the_cli(tmp_path, capsys) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(writer_snapshot()))
    assert main(["diagnose", "-m", "tiny", "--snapshot", str(path), "--trust-pickle",
                 "--no-fixes", "--json"]) == 0
    oom = json.loads(capsys.readouterr().out)["oom"]
    assert (oom["reserved_bytes"], oom["requested_bytes"]) == (72 * MiB, 30 * MiB)


def test_segment_list_of_memory_snapshot(tmp_path) -> None:
    """torch.cuda.memory_snapshot() (and 1.13's _snapshot()) is the segment list alone; 1.13's
    blocks carry "history" (libtorch_python.so of the 1.13.1 wheel names these keys)."""
    segment = {"device": 0, "address": 0x7F0000000000, "total_size": 20 * MiB,
               "allocated_size": 8 * MiB, "active_size": 8 * MiB, "stream": 0,
               "segment_type": "large",
               "blocks": [{"size": 8 * MiB, "state": "active_allocated",
                           "history": [{"addr": 0x7F0000000000, "real_size": 8_000_000}]},
                          {"size": 12 * MiB, "state": "inactive"}]}
    path = tmp_path / "segments.pickle"
    path.write_bytes(pickle.dumps([segment], protocol=2))
    r = snapshot_report(load_snapshot(str(path), trust_pickle=True))
    assert (r.reserved_bytes, r.allocated_bytes, r.largest_free_block_bytes) == (
        20 * MiB, 8 * MiB, 12 * MiB)
    assert (r.requested_bytes, r.free_bytes) == (None, None)


@pytest.mark.parametrize("edit, says", [
    (lambda s: s["segments"][0].update(total_size=21 * MiB), "damaged or edited"),
    (lambda s: s["segments"][0]["blocks"][1].update(state="active_awaiting_free"),
     "active_awaiting_free"),
    (lambda s: s["segments"][2].pop("allocated_size"), "lacks 'allocated_size'"),
    (lambda s: s["segments"][2].update(total_size="64 MiB"), "not a byte count"),
    (lambda s: s["device_traces"][1][2].update(size=-1), "not a byte count"),
    (lambda s: s["segments"].append(None), "not a dict"),
])
def test_damaged_snapshot(tmp_path, edit, says: str) -> None:
    snap = writer_snapshot()
    edit(snap)
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snap))
    with pytest.raises(MemplanError, match=says):
        snapshot_report(load_snapshot(str(path), trust_pickle=True))


def test_damaged_pickles_raise_only_memplan_error(tmp_path) -> None:
    good = pickle.dumps(writer_snapshot(), protocol=2)
    rng = random.Random(3)
    cases = [good[:n] for n in range(0, len(good), 7)]
    for _ in range(400):
        at = rng.randrange(len(good))
        cases.append(good[:at] + bytes([rng.randrange(256)]) + good[at + 1:])
    path = tmp_path / "snap.pickle"
    for raw in cases:
        path.write_bytes(raw)
        try:
            snapshot_report(load_snapshot(str(path), trust_pickle=True))
        except MemplanError:
            pass


class _System:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_unpickler_refuses_os_system(tmp_path, protocol: int) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [_System(f"touch {marker}")]},
                                  protocol=protocol))
    with pytest.raises(MemplanError, match=r"names (posix|os|nt)\.system"):
        load_snapshot(str(path), trust_pickle=True)
    assert not marker.exists()


@pytest.mark.parametrize("raw, says", [
    (b"\x80\x02P1\n.", "persistent id"),  # PERSID: persistent_load
    (b"\x80\x02\x82\x01.", "not a readable pickle"),  # EXT1: an unregistered extension code
    (b"\x80\x02}(X\x08\x00\x00\x00segmentsX", "not a readable pickle"),  # cut short
])
def test_unpickler_refuses_other_ways_to_objects(tmp_path, raw: bytes, says: str) -> None:
    path = tmp_path / "odd.pickle"
    path.write_bytes(raw)
    with pytest.raises(MemplanError, match=says):
        load_snapshot(str(path), trust_pickle=True)

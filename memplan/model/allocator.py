"""A model of PyTorch's CUDA caching allocator: replay allocations and frees, get reserved bytes.

Every rule follows ``c10/cuda/CUDACachingAllocator.cpp`` of torch 2.13 (``DeviceCachingAllocator``);
each constant and function below names the function it comes from. Torch-free and pure Python.

A replay takes events in program order: ``Alloc(id, size_bytes, stream)`` and ``Free(id)``. It
returns reserved bytes after each event (what ``torch.cuda.memory_reserved()`` reads), the reserved
and allocated peaks, the fragmentation (reserved - allocated) at the reserved peak, the inactive
split bytes, the number of segments, and whether an allocation ran out of memory for a given
device capacity. Not modelled: CUDA graph private pools, ``record_stream`` events (a freed block
is reusable at once), ``garbage_collection_threshold`` (it needs ``set_per_process_memory_fraction``
and per-block reuse ages), the CUDA context and memory outside the allocator, and the addresses
cudaMalloc returns (ties in best fit go to the segment created first).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from itertools import groupby
from dataclasses import dataclass, field
from typing import NamedTuple

from memplan.choices import Record
from memplan.errors import MemplanError

# c10/cuda/CUDACachingAllocator.cpp, file-level constants
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1048576  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2097152  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_LARGE_BUFFER = 20971520  # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks
K_MIN_LARGE_ALLOC = 10485760  # kMinLargeAlloc: allocations between 1 and 10 MiB use kLargeBuffer
K_ROUND_LARGE = 2097152  # kRoundLarge: round up large allocations to 2 MiB
# ExpandableSegment's segment_size_: DeviceCachingAllocator::find_expandable_block passes
# `pool->is_small ? kSmallBuffer : kLargeBuffer`, so pages are 2 MiB (small) and 20 MiB (large).
# The address space reserved per expandable segment: `prop.totalGlobalMem + totalGlobalMem / 8`.
NO_LIMIT = 1 << 62  # max_split_size's default, std::numeric_limits<size_t>::max() (CUDAAllocatorConfig)

# A free block's key in its pool's free set: its size, then its segment's creation order, then
# its offset (BlockComparatorSize's order, the order standing for the address), as one int
# whose bits hold each (an offset below 2**64, an order below 2**32), so that keys compare as
# the triples do and ``size << _SIZE`` is the least key of a block of ``size`` bytes.
_ORDER = 64
_SIZE = 96


def _key(size: int, order: int, offset: int) -> int:
    return (size << _SIZE) | (order << _ORDER) | offset


class AllocatorConfig(Record):
    """The PYTORCH_CUDA_ALLOC_CONF options the model follows, and the device's capacity."""


    max_split_size_bytes: int = NO_LIMIT
    # AcceleratorAllocatorConfig::max_non_split_rounding_size (c10/core/AllocatorConfig.h of
    # torch 2.13, option max_non_split_rounding_mb; "The default is 20 MiB"); older releases use
    # kLargeBuffer in its place in get_free_block.
    max_non_split_rounding_bytes: int = K_LARGE_BUFFER
    # AcceleratorAllocatorConfig::large_segment_size_ (c10/core/AllocatorConfig.h of torch 2.13,
    # option large_segment_size_mb, "20 MB by default"): the segment get_allocation_size gives a
    # request between 1 and 10 MiB, kLargeBuffer in releases before the option existed.
    large_segment_bytes: int = K_LARGE_BUFFER
    roundup_power2_divisions: int = 0
    expandable_segments: bool = False
    capacity_bytes: int | None = None  # cudaMalloc fails past it; None: never


def parse_alloc_conf(text: str, capacity_bytes: int | None = None) -> AllocatorConfig:
    """``PYTORCH_CUDA_ALLOC_CONF``'s ``key:value,key:value`` form (CUDAAllocatorConfig::parseArgs);
    ``max_split_size_mb`` in MiB, ``roundup_power2_divisions`` as one number for every size."""
    fields: dict[str, object] = {"capacity_bytes": capacity_bytes}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = item.partition(":")
        if key == "max_split_size_mb":
            fields["max_split_size_bytes"] = int(value) * 1048576
        elif key == "max_non_split_rounding_mb":
            fields["max_non_split_rounding_bytes"] = int(value) * 1048576
        elif key == "large_segment_size_mb":
            fields["large_segment_bytes"] = int(value) * 1048576
        elif key == "roundup_power2_divisions":
            fields["roundup_power2_divisions"] = int(value)
        elif key == "expandable_segments":
            fields["expandable_segments"] = value.strip() == "True"
        else:
            raise MemplanError(f"PYTORCH_CUDA_ALLOC_CONF: {key!r} is not modelled")
    return AllocatorConfig(**fields)  # type: ignore[arg-type]


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """DeviceCachingAllocator::roundup_power2_next_division."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    floor = size & ~(power2_division - 1)
    return size if floor == size else floor + power2_division


def round_size(size: int, divisions: int = 0) -> int:
    """DeviceCachingAllocator::round_size (one ``roundup_power2_divisions`` for every size)."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def get_allocation_size(size: int, large_segment: int = K_LARGE_BUFFER) -> int:
    """DeviceCachingAllocator::get_allocation_size: the cudaMalloc size for a rounded request."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


def should_split(block_size: int, size: int, small: bool, cfg: AllocatorConfig) -> bool:
    """DeviceCachingAllocator::should_split."""
    remaining = block_size - size
    if small or cfg.expandable_segments:
        return remaining >= K_MIN_BLOCK_SIZE
    return size < cfg.max_split_size_bytes and remaining > K_SMALL_SIZE


class Alloc(NamedTuple):
    id: int
    size_bytes: int
    stream: int = 0


class Free(NamedTuple):
    id: int


class Blip(NamedTuple):
    """Tensors of ``sizes_bytes`` made one after another on ``stream``, then all freed, with
    nothing else made or freed between: one event. Replayed exactly as the allocations and
    frees it stands for (``CachingAllocator.blip``). ``counts``: how many tensors of each
    size, in a row (a working set of many pieces of one size); empty: one each."""

    sizes_bytes: tuple[int, ...]
    stream: int = 0
    counts: tuple[int, ...] = ()

    def runs(self) -> list[tuple[int, int]]:
        """(size, how many in a row), in order."""
        if self.counts:
            return list(zip(self.sizes_bytes, self.counts))
        return [(size, len(list(run))) for size, run in groupby(self.sizes_bytes)]

    def tensors(self) -> tuple[int, ...]:
        """Every tensor's size, in order."""
        if not self.counts:
            return self.sizes_bytes
        return tuple(size for size, n in zip(self.sizes_bytes, self.counts) for _ in range(n))


@dataclass(eq=False, slots=True)
class Block:
    offset: int
    size: int
    state: str  # "alloc", "free" or "unmapped" (an expandable segment's unbacked address space)
    # its key in its pool's free set while it is free (``CachingAllocator._add_free``)
    entry: int | None = field(default=None, repr=False)
    # the segment's blocks in address order, linked as Block's prev and next in the source
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


@dataclass(eq=False, slots=True)
class Segment:
    order: int  # creation order: stands for the address in best-fit ties
    stream: int
    small: bool
    expandable: bool
    head: Block | None = None
    # its pool's free set (``CachingAllocator._free``), shared by the pool's segments
    pool: list | None = field(default=None, repr=False)

    @property
    def blocks(self) -> list[Block]:
        """The segment's blocks in address order."""
        out, b = [], self.head
        while b is not None:
            out.append(b)
            b = b.next
        return out

    def single(self) -> bool:
        """Whether the segment is one block (not split)."""
        return self.head is not None and self.head.next is None

    @property
    def page(self) -> int:
        return K_SMALL_BUFFER if self.small else K_LARGE_BUFFER

    def mapped_bytes(self) -> int:
        return sum(b.size for b in self.blocks if b.state != "unmapped")

    def neighbours(self, block: Block) -> tuple[Block | None, Block | None]:
        return block.prev, block.next

    def insert_after(self, block: Block | None, new: Block) -> None:
        """Link ``new`` after ``block`` (None: as the segment's first block)."""
        nxt = self.head if block is None else block.next
        new.prev, new.next = block, nxt
        if nxt is not None:
            nxt.prev = new
        if block is None:
            self.head = new
        else:
            block.next = new

    def unlink(self, block: Block) -> None:
        if block.prev is None:
            self.head = block.next
        else:
            block.prev.next = block.next
        if block.next is not None:
            block.next.prev = block.prev
        block.prev = block.next = None

    def merge(self, block: Block) -> int:
        """try_merge_blocks with both neighbours: absorb each one in the same state (free with
        free, unmapped with unmapped). Returns the bytes subsumed."""
        subsumed = 0
        for other in (block.prev, block.next):
            if other is not None and other.state == block.state:
                block.offset = min(block.offset, other.offset)
                block.size += other.size
                subsumed += other.size
                self.unlink(other)
        return subsumed


@dataclass
class ReplayResult:
    reserved_bytes: list[int]  # after each event
    reserved_peak_bytes: int
    allocated_peak_bytes: int
    fragmentation_bytes: int  # reserved - allocated at the (first) reserved peak
    inactive_split_bytes: int  # at the end
    segments: int  # at the end
    out_of_memory: bool
    oom_event: int | None  # index of the event that ran out of memory
    num_alloc_retries: int


class CachingAllocator:
    """DeviceCachingAllocator's state: segments, their blocks, and the stats it keeps."""

    def __init__(self, cfg: AllocatorConfig | None = None) -> None:
        self.cfg = cfg = cfg or AllocatorConfig()
        # the options best fit reads at every allocation, as plain attributes (cfg is frozen)
        self._limit = cfg.max_split_size_bytes
        self._non_split = cfg.max_non_split_rounding_bytes
        self._plain_round = cfg.roundup_power2_divisions <= 1
        self._expandable = cfg.expandable_segments
        self.segments: list[Segment] = []
        self.live: dict[int, tuple[Segment, Block]] = {}
        self.reserved = 0
        self.allocated = 0
        self.retries = 0
        self._order = 0
        # each pool's free blocks in BlockComparatorSize's order (size, then address), kept
        # as blocks change, so best fit is a binary search: each block's key (``_key``: its
        # size, its segment's order, its offset, as one int), and the key's (block, segment)
        self._free: dict[tuple[int, bool], list[int]] = {}
        self._at: dict[int, tuple[Block, Segment]] = {}

    def _add_free(self, seg: Segment, block: Block) -> None:
        block.entry = key = _key(block.size, seg.order, block.offset)
        self._at[key] = (block, seg)
        insort(self._free.setdefault((seg.stream, seg.small), []), key)

    def _drop_free(self, seg: Segment, block: Block) -> None:
        """Take ``block`` out of its pool's free set (by the key it went in with: a block's
        size and offset change only once it is out)."""
        pool = self._free[(seg.stream, seg.small)]
        i = bisect_left(pool, block.entry)
        assert self._at[pool[i]][0] is block
        del pool[i]

    def _merge_free(self, seg: Segment, block: Block) -> None:
        """``block`` becomes free and absorbs its free neighbours (try_merge_blocks); each
        neighbour leaves its pool's free set by the key it went in with (``_drop_free``)."""
        pool = self._free.setdefault((seg.stream, seg.small), [])
        prev, nxt = block.prev, block.next
        if prev is not None and prev.state == "free":
            i = bisect_left(pool, prev.entry)
            assert self._at[pool[i]][0] is prev
            del pool[i]
            block.offset = prev.offset
            block.size += prev.size
            block.prev = before = prev.prev
            if before is None:
                seg.head = block
            else:
                before.next = block
        if nxt is not None and nxt.state == "free":
            i = bisect_left(pool, nxt.entry)
            assert self._at[pool[i]][0] is nxt
            del pool[i]
            block.size += nxt.size
            block.next = after = nxt.next
            if after is not None:
                after.prev = block
        block.state = "free"
        block.entry = key = _key(block.size, seg.order, block.offset)
        self._at[key] = (block, seg)
        insort(pool, key)

    # --- malloc -------------------------------------------------------------------------------
    def malloc(self, key: int, orig_size: int, stream: int = 0) -> bool:
        """DeviceCachingAllocator::malloc: best fit, else a new segment, else release the cache
        and retry. False when it would raise OutOfMemoryError."""
        if key in self.live or orig_size <= 0:
            raise MemplanError(f"Alloc {key}: already live, or size_bytes {orig_size} <= 0")
        size = self._rounded(orig_size)
        small = size <= K_SMALL_SIZE  # get_pool
        if not self._expandable and self._fit(key, size, stream, small):
            return True
        return self._malloc_uncached(key, size, stream, small)

    def _malloc_uncached(self, key: int, size: int, stream: int, small: bool) -> bool:
        """``malloc`` of a rounded ``size`` past ``_fit`` (without expandable segments: no
        cached block serves it)."""
        found = self.get_free_block(size, stream, small)
        if found is None:
            found = self.alloc_block(size, stream, small)
            if found is None and self.release_available_cached_blocks(size, stream, small):
                found = self.alloc_block(size, stream, small)
            if found is None:
                self.release_cached_blocks()
                self.retries += 1
                found = self.alloc_block(size, stream, small)
            if found is None:
                return False
        seg, block = found
        self.alloc_found_block(key, seg, block, size)
        return True

    def _rounded(self, orig_size: int) -> int:
        """``round_size`` under this configuration (without power-of-two divisions, the
        plain rounding up to kMinBlockSize inline)."""
        if self._plain_round and orig_size >= K_MIN_BLOCK_SIZE:
            return -(-orig_size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
        return round_size(orig_size, self.cfg.roundup_power2_divisions)

    def _fit(self, key: int, size: int, stream: int, small: bool) -> bool:
        """``get_free_block`` then ``alloc_found_block`` in one pass over the pool's free set,
        without expandable segments (the same rules, the block's key taken from where best
        fit found it); False, nothing changed, where no cached block fits."""
        pool = self._free.get((stream, small))
        if not pool:
            return False
        i = bisect_left(pool, size << _SIZE)
        if i == len(pool):
            return False
        block, seg = self._at[pool[i]]
        found, offset = block.size, block.offset
        limit = self._limit
        if (size < limit <= found
                or (size >= limit and found >= size + self._non_split)):
            return False  # get_free_block's oversize rules
        del pool[i]
        remaining = found - size
        if remaining >= K_MIN_BLOCK_SIZE if small else size < limit and remaining > K_SMALL_SIZE:
            rest = Block(offset + size, remaining, "free", None, block, block.next)  # should_split
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            rest.entry = entry = _key(remaining, seg.order, offset + size)
            self._at[entry] = (rest, seg)
            insort(pool, entry)
        block.state = "alloc"
        self.allocated += block.size
        self.live[key] = (seg, block)
        return True

    def _free_blocks(self, stream: int, small: bool) -> list[tuple[Segment, Block]]:
        """The pool's free set, ordered as BlockComparatorSize orders it (size, then address)."""
        return [self._at[k][::-1] for k in self._free.get((stream, small), [])]

    @staticmethod
    def _expandable_size(seg: Segment, block: Block) -> int:
        nxt = seg.neighbours(block)[1]
        return block.size + (nxt.size if nxt is not None and nxt.state == "unmapped" else 0)

    def get_free_block(self, size: int, stream: int, small: bool):
        """DeviceCachingAllocator::get_free_block: the smallest free block of the pool and stream
        that fits (lower_bound on size); the max_split_size rules for oversize blocks."""
        pool = self._free.get((stream, small), [])
        i = bisect_left(pool, size << _SIZE)
        if i == len(pool):
            return None
        at = self._at
        if at[pool[i]][1].expandable:  # best fit by the size the block can grow to
            while (
                i + 1 < len(pool)
                and at[pool[i]][1].expandable
                and self._expandable_size(at[pool[i + 1]][1], at[pool[i + 1]][0])
                < self._expandable_size(at[pool[i]][1], at[pool[i]][0])
            ):
                i += 1
        block, seg = at[pool[i]]
        limit = self.cfg.max_split_size_bytes
        if size < limit and block.size >= limit:
            return None  # do not return an oversized block for a smaller request
        if size >= limit and block.size >= size + self.cfg.max_non_split_rounding_bytes:
            return None  # an oversize block may be rounded up by less than this only
        return seg, block

    def alloc_block(self, size: int, stream: int, small: bool):
        """DeviceCachingAllocator::alloc_block: cudaMalloc get_allocation_size(size) bytes, or
        with expandable segments map pages (try_allocate_expandable_block)."""
        if self.cfg.expandable_segments:
            return self.try_allocate_expandable_block(size, stream, small)
        alloc_size = get_allocation_size(size, self.cfg.large_segment_bytes)
        if not self._can_reserve(alloc_size):
            return None
        seg = self._new_segment(stream, small, expandable=False)
        block = Block(0, alloc_size, "free")
        seg.insert_after(None, block)
        self._add_free(seg, block)
        self.reserved += alloc_size
        return seg, block

    def _can_reserve(self, nbytes: int) -> bool:
        cap = self.cfg.capacity_bytes
        return cap is None or self.reserved + nbytes <= cap

    def _new_segment(self, stream: int, small: bool, expandable: bool) -> Segment:
        seg = Segment(self._order, stream, small, expandable, None,
                      self._free.setdefault((stream, small), []))
        self._order += 1
        self.segments.append(seg)
        return seg

    def alloc_found_block(self, key: int, seg: Segment, block: Block, size: int) -> None:
        """DeviceCachingAllocator::alloc_found_block: split off the remainder if should_split."""
        self._drop_free(seg, block)
        if should_split(block.size, size, seg.small, self.cfg):
            rest = Block(block.offset + size, block.size - size, "free", None, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._add_free(seg, rest)
        block.state = "alloc"
        self.allocated += block.size  # stats.allocated_bytes counts block->size
        self.live[key] = (seg, block)

    # --- expandable segments ------------------------------------------------------------------
    def find_expandable_block(self, size: int, stream: int, small: bool):
        """DeviceCachingAllocator::find_expandable_block: the lowest address where free and
        unmapped blocks together hold ``size``, else a new segment of address space."""
        for seg in self.segments:
            if not (seg.expandable and seg.stream == stream and seg.small == small):
                continue
            for b in seg.blocks:
                if b.state != "unmapped":
                    continue
                start = b.prev if b.prev is not None and b.prev.state == "free" else b
                room, j = 0, start
                while room < size and j is not None and j.state != "alloc":
                    room += j.size
                    j = j.next
                if room >= size:
                    return seg, start
        seg = self._new_segment(stream, small, expandable=True)
        cap = self.cfg.capacity_bytes
        space = NO_LIMIT if cap is None else cap + cap // 8
        seg.insert_after(None, Block(0, -(-space // seg.page) * seg.page, "unmapped"))
        return seg, seg.head

    def map_block(self, seg: Segment, block: Block, size: int) -> Block | None:
        """DeviceCachingAllocator::map_block / ExpandableSegment::map: back whole pages from the
        block's start; the rest stays unmapped; merge with free neighbours."""
        mapped = -(-size // seg.page) * seg.page
        if not self._can_reserve(mapped):
            return None
        if mapped < block.size:
            rest = Block(block.offset + mapped, block.size - mapped, "unmapped")
            seg.insert_after(block, rest)
            block.size = mapped
        self.reserved += mapped
        self._merge_free(seg, block)
        return block

    def try_allocate_expandable_block(self, size: int, stream: int, small: bool):
        """DeviceCachingAllocator::try_allocate_expandable_block."""
        seg, cand = self.find_expandable_block(size, stream, small)
        if cand.state == "unmapped":
            cand = self.map_block(seg, cand, min(cand.size, size))
            if cand is None:
                return None
        while cand.size < size:
            nxt = seg.neighbours(cand)[1]
            assert nxt is not None and nxt.state == "unmapped"
            merged = self.map_block(seg, nxt, min(size - cand.size, nxt.size))
            if merged is None:
                return None
            cand = merged
        return seg, cand

    # --- a blip: tensors made, then all freed -------------------------------------------------
    # Freeing every block a blip split coalesces each back with the free remainders it was cut
    # from (``free_block`` -> ``try_merge_blocks``), so the blocks return to what they were,
    # and each segment the blip created becomes one free block: the blip's only lasting effect
    # is those segments. Within it, best fit (``get_free_block``) and ``should_split`` read
    # block sizes only, so it is simulated on sizes: the pool's free blocks less those taken,
    # and the remainders and new segments the blip itself made (of two blocks of one size,
    # either leaves the same sizes behind). Without expandable segments only (mapping pages
    # changes the blocks a blip leaves). ``least``: should_split's smallest remainder (small
    # pool: kMinBlockSize; large: more than kSmallSize, and only below max_split_size).
    def blip(self, runs: list[tuple[int, int]], stream: int = 0
             ) -> tuple[list[tuple[int, int]], int] | None:
        """Make tensors of ``runs`` ((size, how many in a row), ``Blip.runs``) in order on
        ``stream``, then free them all (the comment
        above). Returns the (reserved, allocated) bytes after the last allocation that created
        a segment (reserved only grows within a blip: that is its reserved peak; empty where
        none did), and the allocated bytes once all are made; None, with nothing changed,
        where an allocation would need more than the capacity (``replay`` then makes them one
        by one)."""
        if self.cfg.expandable_segments:
            return None
        # by pool: the free set's indices taken, as runs [starts[r], ends[r]) apart from one
        # another (``_taken_after``), and the blip's own remainders (sorted)
        taken = {False: ([], []), True: ([], [])}
        extra: dict[bool, list[int]] = {False: [], True: []}
        made: list[tuple[bool, int]] = []  # (small pool, bytes) of each segment made
        acc = [self.reserved, self.allocated, None, False]  # (``_blip_run``)
        divisions = self.cfg.roundup_power2_divisions
        for orig, count in runs:  # a blip's tensors are mostly of one size
            size = round_size(orig, divisions)
            small = size <= K_SMALL_SIZE
            if not self._blip_run(size, count, small, stream, taken[small], extra[small],
                                  made, acc):
                return None
        self._free_segments(stream, made)
        return ([acc[2]] if acc[2] is not None else []), acc[1]

    def blip_leaves_nothing(self, runs: list[tuple[int, int]], stream: int = 0) -> bool:
        """Whether a blip of ``runs`` surely makes no segment, so that it leaves the allocator
        as it found it (the comment above); without expandable segments or max_split_size.
        Sufficient only (False: ``blip`` decides), per pool, for the blip's n tensors of
        that pool (rounded), with should_split's least remainder ``least``, either of:

        - the largest free block L >= sum(size + least): L's remainder after tensors i... is
          still at least sum(size_j + least) over the tensors j after them (best fit takes
          another block, or cuts the tensor from L's remainder, which splits, its rest at
          least that sum plus least);
        - sum over free blocks b of floor(b / u) >= n, u = the largest size + least: placing
          a tensor of size s <= u - least lowers the sum by at most one (a block b >= u it is
          cut from splits, and floor((b - s) / u) >= floor(b / u) - 1; a smaller block
          counts 0 before and after), and while the sum is at least one a block of at least
          u >= s + least is free.

        Either way best fit always finds a block: no tensor reaches ``alloc_block``. Its
        allocated bytes are not known from this (which blocks best fit took is not
        followed)."""
        if self._expandable or self._limit != NO_LIMIT:
            return False
        # by pool: tensors, the largest rounded size, sum(size + least)
        n_small = top_small = sum_small = n_large = top_large = sum_large = 0
        for orig, count in runs:
            size = self._rounded(orig)
            if size <= K_SMALL_SIZE:
                n_small += count
                top_small = size if size > top_small else top_small
                sum_small += count * (size + K_MIN_BLOCK_SIZE)
            else:
                n_large += count
                top_large = size if size > top_large else top_large
                sum_large += count * (size + K_SMALL_SIZE + 1)
        for small, count, largest, total in ((True, n_small, top_small, sum_small),
                                             (False, n_large, top_large, sum_large)):
            if not count:
                continue
            unit = largest + (K_MIN_BLOCK_SIZE if small else K_SMALL_SIZE + 1)
            if not _holds(self._free.get((stream, small)), total, unit, count):
                return False
        return True

    def _blip_run(self, size: int, count: int, small: bool, stream: int,
                  taken: tuple[list[int], list[int]], mine: list[int],
                  made: list[tuple[bool, int]], acc: list) -> bool:
        """``count`` tensors of rounded ``size`` of a blip, each by best fit over the pool's
        free blocks less those ``taken`` names (runs of indices, ``_taken_after``) and the
        blip's own remainders ``mine``, or a new segment; ``acc``: reserved, allocated, the
        last growth, whether the last block taken was the pool's; False where a segment
        would pass the capacity. Without max_split_size (whose oversize rules read each
        block) runs of tensors are taken in one step where best fit takes them in a known
        order: cut from a block of at least twice the size (``_blip_carve``), the next
        blocks under twice it while no remainder fits (``_blip_row``), or a new segment
        each (``_blip_segments``). [ps, pe): the pool's blocks taken since ``taken`` was
        last read (into it, ``_take``, before it is read again); none is taken from
        ``first`` up to ``nxt`` (``_taken_after``)."""
        cfg = self.cfg
        pool = self._free.get((stream, small), ())
        n, first = len(pool), bisect_left(pool, size << _SIZE)
        limit = cfg.max_split_size_bytes
        least = K_MIN_BLOCK_SIZE if small else (K_SMALL_SIZE + 1 if size < limit else NO_LIMIT)
        segment = get_allocation_size(size, cfg.large_segment_bytes)
        below: list[int] = []  # remainders under ``size``: into ``mine`` once the run is done
        fast = limit == NO_LIMIT
        starts, ends = taken
        nxt = ps = pe = -1
        while count:
            if first >= nxt:  # past the blocks taken
                _take(starts, ends, ps, pe)
                ps = pe
                first, nxt = _taken_after(starts, ends, first)
            i = first  # (those before are taken, and stay so)
            a = pool[i] >> _SIZE if i < n else None
            j = bisect_left(mine, size) if mine else 0
            b = mine[j] if j < len(mine) else None
            from_pool = a is not None and (b is None or a <= b)
            found = a if from_pool else b
            made_now, first = (self._blip_row(size, count, pool, i, nxt, mine, below, least,
                                              acc) if fast and b is None and a is not None
                               else (0, i))
            if made_now:
                count -= made_now
            elif fast and found is not None and found >= 2 * size:
                count = self._blip_carve(size, count, found, from_pool, j, mine, below,
                                         least, acc)
                first = i + 1 if from_pool else i
            elif fast and found is None and segment < 2 * size:
                _take(starts, ends, ps, pe)
                return self._blip_segments(size, count, small, segment, made, below, least,
                                           acc) and self._blip_done(mine, below)
            elif self._blip_one(size, small, a, b, j, mine, made, segment, least, acc):
                first = i + 1 if acc[3] else i  # those before are smaller or taken
                count -= 1
            else:
                return False
            if first > i:  # the pool's blocks i to first taken
                if i != pe:
                    _take(starts, ends, ps, pe)
                    ps = i
                pe = first
        _take(starts, ends, ps, pe)
        return self._blip_done(mine, below)

    @staticmethod
    def _blip_done(mine: list[int], below: list[int]) -> bool:
        """A run's remainders under its size join the blip's sorted remainders."""
        if below:
            mine += below
            mine.sort()
        return True

    @staticmethod
    def _blip_carve(size: int, count: int, found: int, from_pool: bool, j: int,
                    mine: list[int], below: list[int], least: int, acc: list) -> int:
        """Tensors of a run cut from ``found``, the smallest block that fits (the pool's, or
        ``mine[j]``), at least twice ``size``: what is left of it stays the smallest block
        that fits (smaller than the one before, which was the smallest) until it is under
        ``size``, so the next tensors take it piece by piece, each split off (the rest at
        least ``size``, above should_split's ``least``). Returns the tensors left; once all
        are cut, a rest of at least ``size`` joins ``mine``, one under it ``below``, and one
        under ``least`` stays with the last tensor (not split off)."""
        if not from_pool:
            del mine[j]
        t = min(count, found // size)
        rest = found - t * size
        acc[1] += t * size
        if rest >= size:
            insort(mine, rest)
        elif rest >= least:
            below.append(rest)
        else:
            acc[1] += rest
        return count - t

    @staticmethod
    def _blip_row(size: int, count: int, pool: list, i: int, nxt: int, mine: list[int],
                  below: list[int], least: int, acc: list) -> tuple[int, int]:
        """With no remainder of the blip's that fits: the pool's blocks from ``i`` on, in
        order, each cut into as many tensors as it holds (``_blip_carve``: what is left of a
        block is under ``size`` and fits no later tensor of the run, so the next block is
        the smallest that fits), until ``count`` are made or the block ``nxt`` taken before
        is reached; blocks of one size a group at a time. Returns how many were made (0
        where the next block was taken before: the caller goes one by one) and the index
        past the last block cut."""
        end = min(i + count, len(pool), nxt)  # each block holds one
        made, k = 0, i
        while k < end and made < count:
            c = pool[k] >> _SIZE
            group = bisect_left(pool, (c + 1) << _SIZE, k, end) - k  # blocks of c bytes
            each, rest = divmod(c, size)
            full = (count - made) // each
            if group < full:
                full = group
            made += full * each
            acc[1] += full * (c if rest < least else c - rest)
            below += [rest] * (full if rest >= least else 0)
            k += full
            if full < group and made < count:  # one block cut short: its rest fits
                t = count - made
                acc[1] += t * size
                insort(mine, c - t * size)
                made, k = count, k + 1
        return made, k

    def _blip_segments(self, size: int, count: int, small: bool, segment: int,
                       made: list[tuple[bool, int]], below: list[int], least: int,
                       acc: list) -> bool:
        """With no block that fits: a new ``segment`` (under twice ``size``) for each of the
        ``count`` tensors left; False where they would pass the capacity."""
        cap = self.cfg.capacity_bytes
        if cap is not None and acc[0] + count * segment > cap:
            return False
        made += [(small, segment)] * count
        acc[0] += count * segment
        split = segment - size >= least
        acc[1] += count * (size if split else segment)
        below += [segment - size] * (count if split else 0)
        acc[2] = (acc[0], acc[1])
        return True

    def _blip_one(self, size: int, small: bool, a: int | None, b: int | None, j: int,
                  mine: list[int], made: list[tuple[bool, int]], segment: int, least: int,
                  acc: list) -> bool:
        """One tensor of a blip: the smaller of the pool's next block ``a`` and the blip's
        next remainder ``b`` (``mine[j]``; the pool's on a tie), unless the oversize rules
        refuse it, else a new ``segment``; ``acc[3]``: whether the pool's block was taken.
        False where the segment would pass the capacity."""
        cfg = self.cfg
        limit = cfg.max_split_size_bytes
        from_pool = a is not None and (b is None or a <= b)
        found = a if from_pool else b
        if found is not None and (size < limit <= found or (
                size >= limit and found >= size + cfg.max_non_split_rounding_bytes)):
            found = None  # get_free_block's oversize rules: a new segment
        new = found is None
        if new:
            found = segment  # alloc_block
            if cfg.capacity_bytes is not None and acc[0] + found > cfg.capacity_bytes:
                return False
            made.append((small, found))
            acc[0] += found
        elif not from_pool:
            del mine[j]
        acc[3] = from_pool and not new
        if found - size >= least:  # should_split
            insort(mine, found - size)
        acc[1] += size if found - size >= least else found
        if new:
            acc[2] = (acc[0], acc[1])
        return True

    def _free_segments(self, stream: int, made: list[tuple[bool, int]]) -> None:
        """Segments of (small pool, bytes) ``made`` on ``stream``, each one free block
        (``_new_segment``, its block linked and added to the free set as ``_add_free``
        does, inline)."""
        free, at, segments = self._free, self._at, self.segments
        for small, seg_bytes in made:
            order = self._order
            self._order = order + 1
            pool = free.setdefault((stream, small), [])
            seg = Segment(order, stream, small, False, None, pool)
            segments.append(seg)
            seg.head = block = Block(0, seg_bytes, "free")
            block.entry = key = (seg_bytes << _SIZE) | (order << _ORDER)
            at[key] = (block, seg)
            insort(pool, key)
            self.reserved += seg_bytes

    # --- free and release ---------------------------------------------------------------------
    def free(self, key: int) -> None:
        """DeviceCachingAllocator::free -> free_block: coalesce with free neighbours."""
        got = self.live.pop(key, None)
        if got is None:
            raise MemplanError(f"Free {key}: no live allocation has that id")
        seg, block = got
        self.allocated -= block.size
        self._merge_free(seg, block)

    def release_available_cached_blocks(self, size: int, stream: int, small: bool) -> bool:
        """DeviceCachingAllocator::release_available_cached_blocks: with max_split_size set, free
        the smallest unsplit oversize block that covers the request, else the largest ones."""
        limit = self.cfg.max_split_size_bytes
        if limit == NO_LIMIT:
            return False
        target = max(size, limit)
        whole = [(s, b) for s, b in self._free_blocks(stream, small) if s.single()]
        big = [sb for sb in whole if sb[1].size >= target]
        if big:
            self._release(big[0][0])
            return True
        released = 0
        for seg, block in reversed([sb for sb in whole if sb[1].size >= limit]):
            if released >= target:
                break
            released += block.size
            self._release(seg)
        return released >= target

    def _release(self, seg: Segment, listed: bool = True) -> None:
        """cudaFree ``seg``; ``listed``: also out of ``segments`` (else the caller does)."""
        for block in seg.blocks:
            if block.state == "free":
                self._drop_free(seg, block)
        self.reserved -= seg.mapped_bytes()
        if listed:
            self.segments.remove(seg)

    def release_cached_blocks(self) -> None:
        """DeviceCachingAllocator::release_cached_blocks -> release_blocks: cudaFree every segment
        that is one free block; in expandable segments unmap every whole free page (unmap_block)
        and drop a segment left with no mapped page (release_expandable_segment). The segments
        kept stay in order, the list rebuilt once."""
        kept = []
        for seg in self.segments:
            if seg.expandable:
                for block in [b for b in seg.blocks if b.state == "free"]:
                    self.unmap_block(seg, block)
                if all(b.state == "unmapped" for b in seg.blocks):
                    continue
            elif seg.single() and seg.head.state == "free":
                self._release(seg, listed=False)
                continue
            kept.append(seg)
        self.segments[:] = kept

    def unmap_block(self, seg: Segment, block: Block) -> None:
        """DeviceCachingAllocator::unmap_block / ExpandableSegment::unmap: the whole pages inside
        the block go back; the partial pages either side stay as free blocks."""
        begin = -(-block.offset // seg.page) * seg.page
        end = (block.offset + block.size) // seg.page * seg.page
        if begin >= end:
            return
        self._drop_free(seg, block)
        parts = [
            Block(block.offset, begin - block.offset, "free"),
            Block(begin, end - begin, "unmapped"),
            Block(end, block.offset + block.size - end, "free"),
        ]
        at = block.prev
        seg.unlink(block)
        for part in parts:
            if part.size > 0:
                seg.insert_after(at, part)
                at = part
        for part in (parts[0], parts[2]):
            if part.size > 0:
                self._add_free(seg, part)
        self.reserved -= end - begin
        seg.merge(parts[1])

    def inactive_split_bytes(self) -> int:
        """stats.inactive_split_bytes: free blocks of split segments (expandable ones excluded,
        as free_block excludes them)."""
        return sum(
            b.size
            for s in self.segments
            if not s.expandable and not s.single()
            for b in s.blocks
            if b.state == "free"
        )


def _taken_after(starts: list[int], ends: list[int], i: int) -> tuple[int, int]:
    """A blip's taken pool indices, as runs ``[starts[r], ends[r])`` in order, none touching
    the next: the first index from ``i`` on not taken, and the first taken after it (a
    bound past any index where none is)."""
    r = bisect_right(starts, i)
    if r and ends[r - 1] > i:
        i = ends[r - 1]  # (untaken: runs do not touch)
    return i, starts[r] if r < len(starts) else NO_LIMIT


def _take(starts: list[int], ends: list[int], i: int, k: int) -> None:
    """Indices ``i`` to ``k`` (none of them taken; none where k <= i) join the taken runs
    (``_taken_after``), merged with a run that ends at ``i`` or starts at ``k``."""
    if k <= i:
        return
    r = bisect_right(starts, i)
    if r and ends[r - 1] == i:
        if r < len(starts) and starts[r] == k:
            ends[r - 1] = ends[r]
            del starts[r], ends[r]
        else:
            ends[r - 1] = k
    elif r < len(starts) and starts[r] == k:
        starts[r] = i
    else:
        starts.insert(r, i)
        ends.insert(r, k)


def replay(events: list[Alloc | Free | Blip], cfg: AllocatorConfig | None = None
           ) -> ReplayResult:
    """Replay events in order; stops at the first allocation that runs out of memory (a
    ``Blip`` is one event: its reserved bytes are those after its frees)."""
    alloc = CachingAllocator(cfg)
    reserved: list[int] = []
    peak_r = peak_a = frag = 0
    oom: int | None = None
    malloc, free, blip, note = alloc.malloc, alloc.free, alloc.blip, reserved.append
    for i, ev in enumerate(events):
        kind = type(ev)
        if kind is Free:
            free(ev.id)
            note(alloc.reserved)
            continue
        if kind is Blip:
            got = blip(ev.runs(), ev.stream)
            ok = True
            if got is None:  # near the capacity: tensor by tensor, as malloc would
                got, ok = _blip_one_by_one(alloc, ev)
            grew, top = got
            for r, a in grew:
                if r > peak_r:
                    peak_r, frag = r, r - a
            if top > peak_a:
                peak_a = top
            if not ok:  # reserved as the last allocation before the one that failed left it
                if grew:
                    note(grew[-1][0])
                oom = i
                break
        elif not malloc(ev.id, ev.size_bytes, ev.stream):
            oom = i
            break
        note(alloc.reserved)
        if alloc.allocated > peak_a:
            peak_a = alloc.allocated
        if alloc.reserved > peak_r:
            peak_r, frag = alloc.reserved, alloc.reserved - alloc.allocated
    return ReplayResult(
        reserved_bytes=reserved,
        reserved_peak_bytes=peak_r,
        allocated_peak_bytes=peak_a,
        fragmentation_bytes=frag,
        inactive_split_bytes=alloc.inactive_split_bytes(),
        segments=len(alloc.segments),
        out_of_memory=oom is not None,
        oom_event=oom,
        num_alloc_retries=alloc.retries,
    )


class ReservedReplay(NamedTuple):
    """``replay_reserved``'s answer: the reserved bytes after the event before each mark, the
    reserved peak, and the event that ran out of memory (None: none did)."""

    at_marks: tuple[int, ...]
    reserved_peak_bytes: int
    oom_event: int | None


def replay_reserved(events: list[Alloc | Free | Blip], cfg: AllocatorConfig | None,
                    marks: list[int]) -> ReservedReplay:
    """``replay`` read for its reserved bytes only: the same allocator, event for event, but
    the allocated bytes are not followed, so a blip that surely makes no segment
    (``CachingAllocator.blip_leaves_nothing``) is passed over (it leaves the allocator as it
    found it); the reserved bytes are kept at ``marks`` (event counts) only. Its reserved
    peak, the reserved bytes at each mark and the out-of-memory event are ``replay``'s.

    Without expandable segments and power-of-two rounding the common cases run inline
    (``_replay_fast``: best fit from the cache, a free, a blip that surely makes no
    segment), the same steps as ``malloc``, ``free`` and ``blip`` take."""
    alloc = CachingAllocator(cfg)
    run = _replay_fast if not alloc._expandable and alloc._plain_round else _replay_events
    peak_r = 0
    oom: int | None = None
    at: list[int] = []
    last = 0  # after an allocation that failed: the reserved bytes as ``replay`` last noted
    pos, n = 0, len(events)
    for mark in marks:  # the events before each mark in turn
        hi = min(max(mark, pos), n)
        if oom is None and hi > pos:
            peak_r, oom, last = run(alloc, events, pos, hi, peak_r)
            pos = hi
        at.append(last if oom is not None else alloc.reserved if mark else 0)
    if oom is None and pos < n:
        peak_r, oom, last = run(alloc, events, pos, n, peak_r)
    return ReservedReplay(tuple(at), peak_r, oom)


def _replay_fast(alloc: CachingAllocator, events: list, lo: int, hi: int, peak_r: int
                 ) -> tuple[int, int | None, int]:
    """``_replay_events`` without expandable segments or power-of-two rounding, its common
    steps inline: a free (``free`` and ``_merge_free`` in place), an allocation from the
    cache or a new segment (``_take_inline``), a blip that surely makes no segment
    (``_quiet_inline``); the rest through the allocator's methods. The allocated bytes are
    not followed (``replay_reserved`` does not read them)."""
    live_pop, at = alloc.live.pop, alloc._at
    take, quiet = _take_inline, _quiet_inline
    for i, ev in enumerate(events[lo:hi], lo):
        kind = type(ev)
        if kind is Free:
            got = live_pop(ev[0], None)
            if got is None:
                alloc.free(ev[0])  # raises
            seg, block = got
            pool = seg.pool
            prev, nxt = block.prev, block.next
            size = block.size
            if prev is not None and prev.state == "free":
                del pool[bisect_left(pool, prev.entry)]
                block.offset = prev.offset
                size += prev.size
                block.prev = before = prev.prev
                if before is None:
                    seg.head = block
                else:
                    before.next = block
            if nxt is not None and nxt.state == "free":
                del pool[bisect_left(pool, nxt.entry)]
                size += nxt.size
                block.next = after = nxt.next
                if after is not None:
                    after.prev = block
            block.size = size
            block.state = "free"
            block.entry = entry = (size << _SIZE) | (seg.order << _ORDER) | block.offset
            at[entry] = (block, seg)
            insort(pool, entry)
            continue
        before = alloc.reserved
        if kind is Alloc:
            if not take(alloc, ev):
                return peak_r, i, before
        elif not quiet(alloc, ev):
            got, ok = _blip_reserved(alloc, ev)
            for r, _ in got:
                if r > peak_r:
                    peak_r = r
            if not ok:  # reserved as the last allocation before the one that failed left it
                return peak_r, i, got[-1][0] if got else before
        if alloc.reserved > peak_r:
            peak_r = alloc.reserved
    return peak_r, None, 0


def _blip_reserved(alloc: CachingAllocator, ev: Blip) -> tuple[list[tuple[int, int]], bool]:
    """``blip``, near the capacity tensor by tensor (``_blip_one_by_one``): the (reserved,
    allocated) after each allocation that grew the reserved bytes, and False where one ran
    out of memory."""
    got = alloc.blip(ev.runs(), ev.stream)
    if got is None:  # near the capacity: tensor by tensor, as malloc would
        (grew, _), ok = _blip_one_by_one(alloc, ev)
        return grew, ok
    return got[0], True


def _take_inline(alloc: CachingAllocator, ev: Alloc) -> bool:
    """``malloc`` of ``ev``: ``_fit`` (best fit from the cache, split if should_split), else
    where get_free_block finds none and the capacity allows, alloc_block's new segment
    split at once (``_segment_inline``), else ``_malloc_uncached``; False where that runs
    out of memory."""
    key, orig, stream = ev
    if orig <= 0 or key in alloc.live:
        alloc.malloc(key, orig, stream)  # raises
    size = (orig + 511) // 512 * 512  # round_size (kMinBlockSize)
    small = size <= K_SMALL_SIZE
    pool = alloc._free.get((stream, small))
    if pool is None:
        pool = alloc._free.setdefault((stream, small), [])
    j = bisect_left(pool, size << _SIZE)
    limit = alloc._limit
    if j < len(pool):
        block, seg = alloc._at[pool[j]]
        found, offset = block.size, block.offset
        if (size < limit <= found
                or (size >= limit and found >= size + alloc._non_split)):
            # get_free_block's oversize rules: none found
            return (_segment_inline(alloc, key, size, stream, small, pool)
                    or alloc._malloc_uncached(key, size, stream, small))
        del pool[j]
        remaining = found - size
        if (remaining >= K_MIN_BLOCK_SIZE if small
                else size < limit and remaining > K_SMALL_SIZE):
            nxt = block.next
            rest = Block(offset + size, remaining, "free", None, block, nxt)
            if nxt is not None:
                nxt.prev = rest
            block.next = rest
            block.size = size
            rest.entry = entry = ((remaining << _SIZE) | (seg.order << _ORDER)
                                  | (offset + size))
            alloc._at[entry] = (rest, seg)
            insort(pool, entry)
        block.state = "alloc"
        alloc.live[key] = (seg, block)
        return True
    return (_segment_inline(alloc, key, size, stream, small, pool)
            or alloc._malloc_uncached(key, size, stream, small))


def _segment_inline(alloc: CachingAllocator, key: int, size: int, stream: int, small: bool,
                    pool: list[int]) -> bool:
    """alloc_block's new segment (get_allocation_size) for ``size``, split at once
    (alloc_found_block, should_split); False, nothing changed, past the capacity."""
    cfg = alloc.cfg
    seg_bytes = (K_SMALL_BUFFER if small else cfg.large_segment_bytes
                 if size < K_MIN_LARGE_ALLOC
                 else (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE)
    if cfg.capacity_bytes is not None and alloc.reserved + seg_bytes > cfg.capacity_bytes:
        return False
    order = alloc._order
    alloc._order = order + 1
    seg = Segment(order, stream, small, False, None, pool)
    alloc.segments.append(seg)
    seg.head = block = Block(0, size, "alloc")
    remaining = seg_bytes - size
    if (remaining >= K_MIN_BLOCK_SIZE if small
            else size < alloc._limit and remaining > K_SMALL_SIZE):
        block.next = rest = Block(size, remaining, "free", None, block, None)
        rest.entry = entry = (remaining << _SIZE) | (order << _ORDER) | size
        alloc._at[entry] = (rest, seg)
        insort(pool, entry)
    else:
        block.size = seg_bytes
    alloc.reserved += seg_bytes
    alloc.live[key] = (seg, block)
    return True


def _quiet_inline(alloc: CachingAllocator, ev: Blip) -> bool:
    """``blip_leaves_nothing`` for a blip of one tensor, or of a run and one more
    (``Builder.blip``'s), in one pool or a run in each, read off the event; others
    through the method."""
    sizes, stream, counts = ev
    if alloc._limit != NO_LIMIT or len(sizes) > 2 or (len(sizes) == 2 and not counts):
        return alloc.blip_leaves_nothing(ev.runs(), stream)
    size = (sizes[0] + 511) // 512 * 512
    small = size <= K_SMALL_SIZE
    least = K_MIN_BLOCK_SIZE if small else K_SMALL_SIZE + 1
    pools = alloc._free
    if len(sizes) == 1:
        return _holds(pools.get((stream, small)), size + least, size + least, 1)
    other = (sizes[1] + 511) // 512 * 512
    many, more = counts
    if small != (other <= K_SMALL_SIZE):  # a run in each pool
        also = K_SMALL_SIZE + 1 if small else K_MIN_BLOCK_SIZE
        return (_holds(pools.get((stream, small)), many * (size + least), size + least, many)
                and _holds(pools.get((stream, not small)), more * (other + also),
                           other + also, more))
    return _holds(pools.get((stream, small)), many * (size + least) + more * (other + least),
                  (size if size > other else other) + least, many + more)


def _holds(pool: list[int] | None, total: int, unit: int, want: int) -> bool:
    """``blip_leaves_nothing``'s rules for one pool: its largest free block holds ``total``
    (the tensors' sizes plus the least remainder each), or its blocks' whole multiples of
    ``unit`` (the largest tensor plus that remainder) number at least ``want`` (counted
    from the largest down, the blocks of one size together: a Mamba scan's working sets
    leave hundreds of equal segments)."""
    if not pool:
        return False
    if pool[-1] >> _SIZE >= total:
        return True
    held, k = 0, len(pool)  # the blocks from k on counted, a size at a time
    while held < want and k:
        size = pool[k - 1] >> _SIZE
        if size < unit:
            break
        j = bisect_left(pool, size << _SIZE, 0, k)  # the first block of that size
        held += (k - j) * (size // unit)
        k = j
    return held >= want


def _replay_events(alloc: CachingAllocator, events: list, lo: int, hi: int, peak_r: int
                   ) -> tuple[int, int | None, int]:
    """Events ``lo`` to ``hi`` through ``alloc`` (``replay_reserved``): the reserved peak
    so far, the event that ran out of memory (None: none) and the reserved bytes then."""
    malloc, free, blip, quiet = (alloc.malloc, alloc.free, alloc.blip,
                                 alloc.blip_leaves_nothing)
    for i, ev in enumerate(events[lo:hi], lo):
        kind = type(ev)
        if kind is Free:
            free(ev.id)
            continue
        before = alloc.reserved
        if kind is Blip:
            runs = ev.runs()
            if quiet(runs, ev.stream):
                continue
            got = blip(runs, ev.stream)
            ok = True
            if got is None:  # near the capacity: tensor by tensor, as malloc would
                got, ok = _blip_one_by_one(alloc, ev)
            for r, _ in got[0]:
                if r > peak_r:
                    peak_r = r
            if not ok:  # reserved as the last allocation before the one that failed left it
                return peak_r, i, got[0][-1][0] if got[0] else before
        elif not malloc(ev.id, ev.size_bytes, ev.stream):
            return peak_r, i, before
        if alloc.reserved > peak_r:
            peak_r = alloc.reserved
    return peak_r, None, 0


def _blip_one_by_one(alloc: CachingAllocator, ev: Blip
                     ) -> tuple[tuple[list[tuple[int, int]], int], bool]:
    """A blip through ``malloc`` and ``free`` (ids below any a sequence uses): the
    (reserved, allocated) after each allocation made and the allocated peak; False where an
    allocation ran out of memory (those made stay, as the replay stops there)."""
    keys, seen, top = [], [], alloc.allocated
    for n, size in enumerate(ev.tensors()):
        key = -1 - n
        if not alloc.malloc(key, size, ev.stream):
            return (seen, top), False
        keys.append(key)
        seen.append((alloc.reserved, alloc.allocated))
        top = max(top, alloc.allocated)
    for key in keys:
        alloc.free(key)
    return (seen, top), True

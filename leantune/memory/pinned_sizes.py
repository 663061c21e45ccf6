"""What pinned host memory really costs: PyTorch's caching host allocator rounds every pinned
allocation up to a power of two and keeps the block for reuse (by blocks of that size), so pinned
memory that is allocated per tensor (the host step's gradient copies) reserves the rounded sizes.
The planner prices pinned staging with it and the engine bounds what it keeps in flight with it,
so the two agree."""


def caching_host_size(n: int) -> int:
    """What PyTorch's caching host allocator reserves for a pinned tensor of n bytes."""
    return 1 << (max(int(n), 1) - 1).bit_length()

"""rows_ahead: async speculation's two device-side steps, one launch each.

With async scheduling the host plans step N+1 before step N's tokens reach it. If step N
verified drafts, step N+1's row for a request starts wherever step N's accepted count A puts
it, so the host plans it as if A = 0 and the device finishes the job:

1. ``count_accepted``, right after step N samples: for each row that samples (its samples are
   ``samples[sample_starts[r]:sample_starts[r + 1]]``, the target's choice after each of its
   last positions), A = how many leading drafts equal the sample before them (the draft after
   sample i is ``input_ids[logits_indices[i] + 1]``), and the next token = the sample after
   those A (the target's own). A row without drafts has one sample: A = 0, next = that sample.
2. ``move_rows``, before step N+1's forward: each token of a row planned ahead (``dst``, its
   index in the step) moves by the A of its source row ``src`` in step N: position + A, slot
   from the block table at the new position (the blocks were held for the longest outcome),
   token = step N's next token at offset 0, else ``window[win + A]`` (the drafts proposed for
   every outcome); its row's length grows by A (once: at offset 0). In place.

Each is a handful of scalars a row, so the cost is the launch: one kernel where the same work in
torch takes about twenty small ops, each a launch of its own on the host's clock. The torch
references below are what a CPU runs (and what the tests compare against).

Run ``python -m labkit.kernels.rows_ahead`` to check both kernels against their references.
"""
import labkit  # noqa: F401  (before triton: interpreter on where there is no GPU)
import torch
import triton
import triton.language as tl
from labkit.kernels.grid import next_power_of_2


# Nothing is specialised on values that change from step to step: an integer's (equal to 1, a
# multiple of 16) or a pointer's alignment (the metadata arrays are views into one buffer, at
# offsets set by the step's sizes). Each new specialisation would compile in the middle of a
# timed run; these kernels load a few scalars a program, which alignment does not speed up.
_COUNT_POINTERS = ["samples_ptr", "input_ids_ptr", "logits_indices_ptr", "sample_starts_ptr",
                   "accepted_ptr", "next_ptr"]
_MOVE_POINTERS = ["ids_ptr", "pos_ptr", "slots_ptr", "lens_ptr", "tables_ptr", "dst_ptr",
                  "src_ptr", "off_ptr", "row_ptr", "win_ptr", "window_ptr", "next_ptr",
                  "accepted_ptr"]


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=_COUNT_POINTERS)
def count_accepted_kernel(
    samples_ptr,        # int64 [num_sampled]
    input_ids_ptr,      # int32 [num_tokens]
    logits_indices_ptr, # int32 [num_sampled]: the input token each sample follows
    sample_starts_ptr,  # int32 [num_rows + 1]
    accepted_ptr, next_ptr,  # int64 [num_rows] out
    num_tokens,
    BLOCK: tl.constexpr,     # >= the most samples a row has
):
    r = tl.program_id(0)
    start = tl.load(sample_starts_ptr + r)
    n = tl.load(sample_starts_ptr + r + 1) - start
    j = tl.arange(0, BLOCK)
    has_draft = j < n - 1  # every sample but the row's last is followed by a draft
    target = tl.load(samples_ptr + start + j, mask=j < n, other=-1)
    follows = tl.load(logits_indices_ptr + start + j, mask=has_draft, other=0) + 1
    draft = tl.load(input_ids_ptr + tl.minimum(follows, num_tokens - 1), mask=has_draft,
                    other=-1)
    stop = tl.where(has_draft & (draft.to(tl.int64) == target), BLOCK, j)
    accepted = tl.min(stop, axis=0)
    tl.store(accepted_ptr + r, accepted.to(tl.int64))
    tl.store(next_ptr + r, tl.load(samples_ptr + start + accepted))


def count_accepted(samples: torch.Tensor, input_ids: torch.Tensor,
                   logits_indices: torch.Tensor, sample_starts: torch.Tensor,
                   max_row_samples: int, *, use_kernel: bool | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted, next_tokens)``, int64 ``[num_rows]`` (see the module docstring); nothing is
    read back to the host. ``max_row_samples``: the most samples a row has (k + 1).
    ``use_kernel``: default on a GPU, the torch reference elsewhere."""
    rows = sample_starts.numel() - 1
    if use_kernel is None:
        use_kernel = samples.is_cuda
    if not use_kernel or rows == 0:
        return count_accepted_ref(samples, input_ids, logits_indices, sample_starts)
    accepted = torch.empty(rows, dtype=torch.int64, device=samples.device)
    nxt = torch.empty_like(accepted)
    block = next_power_of_2(max(2, max_row_samples))  # one compile per engine, not per step
    count_accepted_kernel[(rows,)](samples.long(), input_ids, logits_indices, sample_starts,
                                   accepted, nxt, input_ids.numel(), BLOCK=block)
    return accepted, nxt


def count_accepted_ref(samples, input_ids, logits_indices, sample_starts):
    """The same count in torch: a mismatch mask, then the first mismatch of each row."""
    m, device = samples.numel(), samples.device
    counts = sample_starts.long().diff()
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    i = torch.arange(m, device=device)
    follows = input_ids[(logits_indices.long() + 1).clamp(max=max(input_ids.numel() - 1, 0))]
    same_row = torch.zeros(m, dtype=torch.bool, device=device)
    same_row[:-1] = rows[1:] == rows[:-1]
    stop = torch.where(same_row & (follows.long() == samples.long()), m, i)
    first_stop = torch.full((counts.numel(),), m, device=device).scatter_reduce(
        0, rows, stop, "amin")
    return first_stop - sample_starts[:-1].long(), samples[first_stop.clamp(max=m - 1)].long()


@triton.jit(do_not_specialize=["table_stride", "block_size"],
            do_not_specialize_on_alignment=_MOVE_POINTERS)
def move_rows_kernel(
    ids_ptr, pos_ptr, slots_ptr, lens_ptr,  # int32 step metadata, moved in place
    tables_ptr, table_stride,               # int32 [num_rows, width]
    dst_ptr, src_ptr, off_ptr, row_ptr, win_ptr, window_ptr,  # int32 [num_moved] (window: any)
    next_ptr, accepted_ptr,                 # int64 [previous step's rows that sample]
    block_size,
):
    t = tl.program_id(0)
    dst = tl.load(dst_ptr + t)
    src = tl.load(src_ptr + t)
    off = tl.load(off_ptr + t)
    row = tl.load(row_ptr + t)
    a = tl.load(accepted_ptr + src).to(tl.int32)
    p = tl.load(pos_ptr + dst) + a
    tl.store(pos_ptr + dst, p)
    block = tl.load(tables_ptr + row * table_stride + p // block_size)
    tl.store(slots_ptr + dst, block * block_size + p % block_size)
    if off == 0:
        tl.store(ids_ptr + dst, tl.load(next_ptr + src).to(tl.int32))
        tl.store(lens_ptr + row, tl.load(lens_ptr + row) + a)
    else:
        tl.store(ids_ptr + dst, tl.load(window_ptr + tl.load(win_ptr + t) + a))


def move_rows(ids, pos, slots, lens, tables, dst, src, off, row, win, window, next_tokens,
              accepted, block_size: int, *, use_kernel: bool | None = None) -> None:
    """Move the planned-ahead tokens ``dst`` (see the module docstring) in place: ``ids``,
    ``pos``, ``slots``: int32 ``[num_tokens]``; ``lens``: int32 ``[num_rows]``; ``tables``:
    int32 ``[num_rows, width]``; ``dst, src, off, row, win``: int32 ``[num_moved]``;
    ``window`` int32; ``next_tokens, accepted``: the previous step's ``count_accepted``.
    ``use_kernel``: default on a GPU, the torch reference elsewhere."""
    if use_kernel is None:
        use_kernel = ids.is_cuda
    if not use_kernel:
        return move_rows_ref(ids, pos, slots, lens, tables, dst, src, off, row, win, window,
                             next_tokens, accepted, block_size)
    if dst.numel():
        move_rows_kernel[(dst.numel(),)](ids, pos, slots, lens, tables, tables.stride(0), dst,
                                         src, off, row, win, window, next_tokens, accepted,
                                         block_size)


def move_rows_ref(ids, pos, slots, lens, tables, dst, src, off, row, win, window, next_tokens,
                  accepted, block_size: int) -> None:
    """The same moves in torch, in place."""
    dst, src, row = dst.long(), src.long(), row.long()
    shift = accepted[src].to(pos.dtype)
    moved = pos[dst] + shift
    first = off == 0
    token = torch.where(first, next_tokens[src].to(ids.dtype),
                        window[(win + torch.where(first, 0, shift)).long()])
    pos[dst] = moved
    slots[dst] = tables[row, (moved // block_size).long()] * block_size + moved % block_size
    ids[dst] = token
    lens[row[first]] += shift[first]


if __name__ == "__main__":
    import random

    from labkit.device import interpreter_on

    device = labkit.select_device("auto")
    rng = random.Random(0)
    for trial in range(20):
        # count_accepted: rows of one sample (no drafts) and verify rows of k + 1
        samples, ids, logits_indices, starts = [], [], [], [0]
        for _ in range(rng.randrange(1, 6)):
            k = rng.choice([0, rng.randrange(1, 6)])
            ids += [rng.randrange(3) for _ in range(rng.randrange(0, 3) + k + 1)]
            logits_indices += range(len(ids) - k - 1, len(ids))
            samples += [rng.randrange(3) for _ in range(k + 1)]
            starts.append(len(samples))
        t = lambda x, d=torch.int32: torch.tensor(x, dtype=d, device=device)  # noqa: E731
        got = count_accepted(t(samples, torch.int64), t(ids), t(logits_indices), t(starts), 6,
                             use_kernel=True)
        want = count_accepted_ref(t(samples, torch.int64), t(ids), t(logits_indices), t(starts))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (trial, got, want)
        # move_rows: every token of every row planned ahead, tables wide enough for any move
        rows, bs, k = rng.randrange(1, 5), rng.choice([2, 4, 16]), rng.randrange(1, 5)
        width = 8 + (2 * k) // bs + 1
        tables = torch.randperm(rows * width, device=device).int().view(rows, width)
        base = [rng.randrange(0, 4 * bs) for _ in range(rows)]
        dst = list(range(rows * (k + 1)))
        src = [r for r in range(rows) for _ in range(k + 1)]
        off = [j for _ in range(rows) for j in range(k + 1)]
        win = [rows * 2 * k if j == 0 else r * 2 * k + j - 1 for r in range(rows)
               for j in range(k + 1)]
        window = t([rng.randrange(100) for _ in range(rows * 2 * k)] + [0])
        meta = [t([b + j for b in base for j in range(k + 1)]), t([0] * len(dst)),
                t([b + k + 1 for b in base])]
        nxt, acc = t([7] * rows, torch.int64), t([rng.randrange(k + 1) for _ in range(rows)],
                                                 torch.int64)
        out = [[t([-1] * len(dst)), *(m.clone() for m in meta)] for _ in range(2)]
        for o, fn in zip(out, (move_rows, move_rows_ref)):
            args = (*o, tables, t(dst), t(src), t(off), t(src), t(win), window, nxt, acc, bs)
            fn(*args, use_kernel=True) if fn is move_rows else fn(*args)
        assert all(torch.equal(a, b) for a, b in zip(*out)), trial
    print(f"count_accepted and move_rows match their references ({device})")
    if interpreter_on():
        print("(Triton's interpreter runs the kernels in Python: no timing here)")
    else:
        from labkit.measure.bench import measure
        m = [t([0] * 5), t([0] * 5), t([0] * 5), t([0])]
        table = t(list(range(64))).view(1, 64)
        args = (t(list(range(5))), t([0] * 5), t(list(range(5))), t([0] * 5),
                t([8, 0, 1, 2, 3]), t(list(range(9))), t([5], torch.int64), t([2], torch.int64))
        for name, fn in (("triton", move_rows), ("torch ", move_rows_ref)):
            print(name, "move_rows (one row, k = 4)", measure(
                lambda: fn(*m, table, *args, 16), device=device, warmup=5, repeats=200))

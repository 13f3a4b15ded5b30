"""The batching scheduler's forward on tiny synthetic models: every row of a mixed batch
(prompt chunks and decode rows of several sequences, paged cells) gives the logits that
evaluating its sequence alone, one token at a time, gives, bit for bit."""
import numpy as np
import pytest

import minillm
from minillm.serving.kv_pool import BLOCK, KVPool
from synthetic import SyntheticModel


def lone_logits(model, ids) -> np.ndarray:
    """(len(ids), V): a sequence evaluated alone, one token a call (llama.cpp's decode path)."""
    cache = model.new_cache(len(ids) + 1)
    return np.concatenate([model.eval(ids[i:i + 1], cache, batch_size=1) for i in range(len(ids))])


def run_schedule(model, pool, seqs, steps):
    """steps: per step a list of (seq, n tokens); rows of each step in one forward_rows call,
    the sequences' last rows of the step at the end. Returns {seq: {position: logits}}."""
    done = {s: 0 for s in seqs}
    got = {s: {} for s in seqs}
    for step in steps:
        inner, last = [], []
        for s, n in step:
            start = done[s]
            pool.assign(s, pool.blocks_needed(s, start, start + n))
            rows = [(s, start + i, seqs[s][start + i]) for i in range(n)]
            inner += rows[:-1]
            last.append(rows[-1])
            done[s] += n
        rows = np.array(inner + last, np.int64)
        kv_of = pool.batch_kv(rows[:, 0].copy(), rows[:, 1].copy())
        logits = model.backend.forward_rows(rows[:, 2].copy(), rows[:, 1].copy(), kv_of, 0, pool.n_ctx)
        for (s, pos, _), row in zip(inner + last, logits):
            got[s][pos] = row
    return got


@pytest.mark.parametrize("arch,fmt", [("llama", "Q4_K"), ("llama", "Q6_K"), ("gemma3", "Q4_0"), ("gemma3", "Q4_K")])
def test_rows_of_a_mixed_batch_equal_each_sequence_alone(tmp_path, arch, fmt):
    # gemma3 with 7 layers: 6 sliding-window layers (window 8) and a global one; in one case a
    # sequence runs past position 256, where a lone query's attention splits its cells across
    # threads (the others keep it short: its lone evaluation is one call a token)
    sm = SyntheticModel(arch, fmt, n_layer=2 if arch == "llama" else 7).build()
    model = minillm.load(sm.write(tmp_path / "m.gguf"))
    rng = np.random.default_rng(5)
    long = arch == "gemma3" and fmt == "Q4_K"
    chunks = (128, 100, 50, 22) if long else (30, 20, 5, 5)
    seqs = {0: rng.integers(0, sm.n_vocab, sum(chunks)), 1: rng.integers(0, sm.n_vocab, 23),
            2: rng.integers(0, sm.n_vocab, 20)}
    pool = KVPool(model.backend, n_seqs=3, n_ctx=512, n_cells=3 * 512, n_batch=128)
    steps = [[(0, chunks[0]), (1, 9)], [(0, chunks[1]), (1, 5), (2, 12)], [(0, chunks[2]), (1, 1)],
             [(1, 1), (0, chunks[3]), (2, 1)]]
    steps += [[(1, 1), (2, 1)]] * 7
    got = run_schedule(model, pool, seqs, steps)
    for s, ids in seqs.items():
        n = len(got[s])
        assert sorted(got[s]) == list(range(n))
        np.testing.assert_array_equal(np.array([got[s][p] for p in range(n)]), lone_logits(model, ids[:n]))


def test_pool_hands_out_and_takes_back_blocks(tmp_path):
    sm = SyntheticModel("gemma3", "Q8_0", n_layer=7).build()
    model = minillm.load(sm.write(tmp_path / "m.gguf"))
    pool = KVPool(model.backend, n_seqs=2, n_ctx=256, n_cells=300, n_batch=16)
    assert pool.n_cells == 304 and pool.free_cells == 304  # whole blocks of BLOCK cells
    needed = pool.blocks_needed(0, 0, 40)
    assert len(needed["global"]) == 3 and len(needed["local"]) == 2  # the ring of 8 + 16 slots
    pool.assign(0, needed)
    assert pool.free_cells == 304 - 3 * BLOCK
    pool.release(0, keep=20)  # a prefix kept: positions 20.. forgotten, block 3 free again
    assert pool.free_cells == 304 - 2 * BLOCK
    g = pool.groups["global"]
    assert (g.kv_pos[g.rows_of(0, np.arange(20, 32))] == -1).all()
    pool.release(0)
    assert pool.free_cells == 304 and pool.blocks_held(0) == 0
    pool.assign(0, pool.blocks_needed(0, 0, 256))  # a full context: 16 of the 19 blocks
    assert pool.can_assign(pool.blocks_needed(1, 0, 48)) and not pool.can_assign(pool.blocks_needed(1, 0, 49))

"""The chat LLM's candidate sampling gives the tokens of the full-vocabulary path, bit for bit.

``sample_candidates`` looks only at each row's largest logits; ``sample_full_vocabulary`` runs
top-k, top-p and the Gumbel-max draw over the whole row. The reference below is the full path
as it was written before the candidate path existed, with two switches for the two changes it
got: top-p's sort orders equal logits by index (``stable``; the CUDA sort already did, the
CPU's did not), and entries filtered to -inf stay -inf in the draw (``guard``; a draw of exactly
1.0 made them NaN, which ``argmax`` picked).
"""

from __future__ import annotations

import pytest
import torch

from serve_app.engines.minicpmo.device.llm_step import LLMStepInputs, sample_next_token
from serve_app.engines.minicpmo.device.sampling import (
    CANDIDATE_TOP_K,
    hashed_uniform,
    hashed_uniform_at,
    sample_candidates,
    sample_full_vocabulary,
    sample_or_argmax_at,
    top_k_top_p_candidates,
)

QWEN_VOCAB = 151936
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# ---- the full path before the candidate path: the reference ---------------------------------

_M64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _M64
    return value - (1 << 64) if value >= (1 << 63) else value


_G, _M1, _M2 = (_signed(v) for v in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def reference_uniform(seeds: torch.Tensor, counters: torch.Tensor, size: int) -> torch.Tensor:
    index = torch.arange(size, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _G + counters[:, None] * _M1 + index[None, :] * _G
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    return ((_shr(x, 11).to(torch.float64) + 0.5) / float(1 << 53)).to(torch.float32)


def reference_filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     stable: bool = True) -> torch.Tensor:
    """Top-k then top-p (``min_keep`` 1) over whole rows: the rows the draw sees."""
    k = torch.clamp(top_k, min=1, max=logits.shape[-1])
    threshold = torch.sort(logits, descending=True, dim=-1).values.gather(-1, k - 1)
    logits = logits.masked_fill(logits < threshold, float("-inf"))
    sorted_logits, sorted_index = torch.sort(logits, descending=False, dim=-1, stable=stable)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p)
    remove[..., -1:] = False
    remove = remove.scatter(-1, sorted_index, remove)
    return logits.masked_fill(remove, float("-inf"))


def reference_tokens(logits, top_k, top_p, greedy, seeds, counters, stable=True, guard=True):
    filtered = reference_filter(logits, top_k, top_p, stable)
    gumbel = -torch.log(-torch.log(reference_uniform(seeds, counters, logits.shape[-1])))
    keep = greedy[:, None] | (filtered == float("-inf")) if guard else greedy[:, None]
    return torch.where(keep, filtered, filtered + gumbel).argmax(dim=-1)


# ---- cases ---------------------------------------------------------------------------------


def random_rows(generator: torch.Generator, batch: int, size: int, bf16: bool,
                device: str) -> tuple[torch.Tensor, ...]:
    """Logits [B, V] (bfloat16 values, full of ties, when ``bf16``) and per-row parameters:
    top_k mostly small, some far above any candidate bound; top_p in (0, 1], some 1; a quarter
    greedy; any seeds and counters."""
    scale = torch.rand(batch, 1, generator=generator) * 6 + 0.5
    logits = torch.randn(batch, size, generator=generator) * scale
    if bf16:
        logits = logits.bfloat16().float()
    top_k = torch.randint(1, 300, (batch, 1), generator=generator)
    large = torch.rand(batch, 1, generator=generator) < 0.15
    top_k = torch.where(large, torch.randint(1000, 100_001, (batch, 1), generator=generator), top_k)
    top_p = torch.rand(batch, 1, generator=generator).clamp(min=0.01)
    top_p = torch.where(torch.rand(batch, 1, generator=generator) < 0.2, 1.0, top_p)
    greedy = torch.rand(batch, generator=generator) < 0.25
    seeds = torch.randint(0, 2 ** 62, (batch,), generator=generator)
    counters = torch.randint(0, 4096, (batch,), generator=generator) * 7919 + 1
    return tuple(t.to(device) for t in (logits, top_k, top_p, greedy, seeds, counters))


def survivors(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """How many entries of each row top-k keeps (all those equal to the k-th largest too)."""
    k = torch.clamp(top_k, min=1, max=logits.shape[-1])
    kth = torch.sort(logits, descending=True, dim=-1).values.gather(-1, k - 1)
    return (logits >= kth).sum(dim=-1)


def assert_exact(logits, top_k, top_p, greedy, seeds, counters, bounds=(CANDIDATE_TOP_K,)):
    """Candidates (for each ``max_top_k`` in ``bounds``), full path and reference agree; the
    candidates decline exactly the rows where top-k keeps more than ``max_top_k`` entries, and
    their filtered logits are the filtered row itself. Returns the tokens of the first bound's
    candidates (-1 where declined) and of the full path."""
    full = sample_full_vocabulary(logits, top_k, top_p, greedy, seeds, counters)
    assert torch.equal(full, reference_tokens(logits, top_k, top_p, greedy, seeds, counters))
    want = reference_filter(logits, top_k, top_p)
    kept = survivors(logits, top_k)
    size = logits.shape[-1]
    first = None
    for max_top_k in bounds:
        fast = sample_candidates(logits, top_k, top_p, greedy, seeds, counters, max_top_k)
        declined = (kept > max_top_k) & (size > max_top_k + 1)
        assert torch.equal(fast < 0, declined)
        assert torch.equal(fast[~declined], full[~declined])
        filtered, index, complete = top_k_top_p_candidates(logits, top_k, top_p, max_top_k + 1)
        rebuilt = torch.full_like(logits, float("-inf")).scatter(-1, index, filtered)
        assert torch.equal(complete, ~declined)
        assert torch.equal(rebuilt[complete], want[complete])
        first = fast if first is None else first
    return first, full


def split_ties(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> int:
    """Rows where top-p keeps some entries of a group of equal logits and removes others."""
    k = torch.clamp(top_k, min=1, max=logits.shape[-1])
    kth = torch.sort(logits, descending=True, dim=-1).values.gather(-1, k - 1)
    after_k = logits >= kth
    after_p = torch.isfinite(reference_filter(logits, top_k, top_p))
    count = 0
    for row in range(logits.shape[0]):
        kept = set(logits[row][after_p[row]].tolist())
        removed = set(logits[row][after_k[row] & ~after_p[row]].tolist())
        count += bool(kept & removed)
    return count


# ---- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("size, batches", [(QWEN_VOCAB, 2), (5000, 6), (1000, 6), (40, 6)])
def test_candidates_give_the_full_vocabulary_tokens(device, bf16, size, batches):
    generator = torch.Generator().manual_seed(size + bf16)
    served = 0
    for trial in range(batches):
        batch = [64, 1][trial] if trial < 2 else int(torch.randint(2, 65, (1,), generator=generator))
        case = random_rows(generator, batch, size, bf16, device)
        fast, _ = assert_exact(*case, bounds=(CANDIDATE_TOP_K, 16 + 100 * trial))
        served += int((fast >= 0).sum())
    assert served > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [QWEN_VOCAB, 3000])
def test_ties_at_the_kth_value(device, size):
    """Entries equal to the k-th largest: top-k keeps them all. Within the candidates the
    candidates path serves the row; past them it declines it."""
    generator = torch.Generator().manual_seed(7)
    batch, max_top_k = 48, 32
    logits, top_k, top_p, greedy, seeds, counters = random_rows(generator, batch, size, True, "cpu")
    top_k = torch.randint(1, max_top_k + 1, (batch, 1), generator=generator)
    for row in range(batch):
        order = logits[row].argsort(descending=True)
        kth = float(logits[row, order[top_k[row, 0] - 1]])
        ties = int(torch.randint(0, 3 * max_top_k, (1,), generator=generator))
        below = order[top_k[row, 0]:]
        chosen = below[torch.randperm(len(below), generator=generator)[:ties]]
        logits[row, chosen] = kth
    top_p[: batch // 2] = 1.0
    case = tuple(t.to(device) for t in (logits, top_k, top_p, greedy, seeds, counters))
    fast, _ = assert_exact(*case, bounds=(max_top_k,))
    assert 0 < int((fast < 0).sum()) < batch  # both kinds of rows were there


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [QWEN_VOCAB, 2000])
def test_ties_at_the_top_p_cut(device, size):
    """Few distinct logits: groups of equal values straddle top-p's cut, which removes them in
    index order (lowest first) on both paths."""
    generator = torch.Generator().manual_seed(11)
    batch = 32
    logits, top_k, top_p, greedy, seeds, counters = random_rows(generator, batch, size, False, "cpu")
    logits = torch.randint(0, 6, (batch, size), generator=generator).float() * 0.25
    logits[:, :40] += 1.5  # a top group of 40 over five values
    top_k = torch.randint(5, 41, (batch, 1), generator=generator)
    greedy[:] = False
    case = tuple(t.to(device) for t in (logits, top_k, top_p, greedy, seeds, counters))
    assert_exact(*case, bounds=(40, CANDIDATE_TOP_K))
    assert split_ties(*case[:3]) >= batch // 4


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_ties_go_to_the_lowest_id(device):
    size, batch = 5000, 8
    logits = torch.randn(batch, size, generator=torch.Generator().manual_seed(3))
    top = [torch.tensor([4000, 17, 2500]), torch.tensor([9, 8]), torch.tensor([4999, 0])]
    for row in range(batch):
        logits[row, top[row % 3]] = 10.0
    args = (torch.full((batch, 1), 50), torch.ones(batch, 1), torch.ones(batch, dtype=torch.bool),
            torch.arange(batch), torch.arange(batch))
    case = tuple(t.to(device) for t in (logits, *args))
    fast, _ = assert_exact(*case)
    assert fast.tolist() == [int(top[row % 3].min()) for row in range(batch)]


@pytest.mark.parametrize("device", DEVICES)
def test_noise_at_indices_is_the_whole_rows_noise(device):
    generator = torch.Generator().manual_seed(5)
    batch, size = 37, 1999
    seeds = torch.randint(-2 ** 63, 2 ** 63 - 1, (batch,), generator=generator).to(device)
    counters = torch.randint(0, 2 ** 40, (batch,), generator=generator).to(device)
    index = torch.stack([torch.randperm(size, generator=generator)[:301] for _ in range(batch)])
    index = index.to(device)
    whole = hashed_uniform(seeds, counters, size)
    assert torch.equal(whole, reference_uniform(seeds, counters, size))
    some = hashed_uniform_at(seeds, counters, index)
    assert torch.equal(some, whole.gather(-1, index))
    gumbel = lambda u: -torch.log(-torch.log(u))  # noqa: E731
    assert torch.equal(gumbel(some), gumbel(whole).gather(-1, index))


def test_a_draw_of_one_never_picks_a_removed_token():
    """Seed 0 at counter 62 draws exactly 1.0 at id 72759 (+inf Gumbel noise). Before, a removed
    id there became NaN (-inf + inf) and ``argmax`` returned it; now it stays -inf."""
    seeds, counters = torch.tensor([0]), torch.tensor([62])
    assert float(hashed_uniform(seeds, counters, QWEN_VOCAB)[0, 72759]) == 1.0
    logits = torch.randn(1, QWEN_VOCAB, generator=torch.Generator().manual_seed(0))
    logits[0, 72759] = -20.0
    case = (logits, torch.tensor([[20]]), torch.tensor([[0.9]]), torch.tensor([False]), seeds, counters)
    assert int(reference_tokens(*case, stable=False, guard=False)) == 72759
    fast, full = assert_exact(*case)
    assert int(full) != 72759 and torch.isfinite(reference_filter(*case[:3])[0, full])


def test_the_full_path_is_unchanged_without_ties_or_draws_of_one():
    """On float32 logits with no equal values at top-p's cut, the full path gives the tokens it
    gave before, but in rows where a removed entry drew exactly 1.0 (see above)."""
    generator = torch.Generator().manual_seed(13)
    for _ in range(2):
        logits, top_k, top_p, greedy, seeds, counters = random_rows(
            generator, 64, QWEN_VOCAB, False, "cpu")
        before = reference_tokens(logits, top_k, top_p, greedy, seeds, counters,
                                  stable=False, guard=False)
        now = sample_full_vocabulary(logits, top_k, top_p, greedy, seeds, counters)
        removed = reference_filter(logits, top_k, top_p) == float("-inf")
        one = ((reference_uniform(seeds, counters, QWEN_VOCAB) == 1.0) & removed).any(-1) & ~greedy
        assert torch.equal(now[~one], before[~one])
        # where one was, before picked a removed token
        assert bool(removed[one].gather(-1, before[one, None]).all())


def test_sample_or_argmax_at_an_empty_row_gives_zero():
    logits = torch.full((2, 3), float("-inf"))
    index = torch.tensor([[5, 2, 9], [1, 7, 3]])
    got = sample_or_argmax_at(logits, index, torch.tensor([True, False]), torch.tensor([1, 2]),
                              torch.tensor([3, 4]))
    assert got.tolist() == [0, 0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [QWEN_VOCAB, 4000])
def test_sample_next_token_paths_agree(device, size):
    """The LLM step's processors (repetition penalty, temperature, then the filters and draw)
    along every path: "auto" serves top_k within CANDIDATE_TOP_K from candidates and falls back
    for the rest; "candidates" marks what it cannot do with -1."""
    generator = torch.Generator().manual_seed(size)
    batch, width = 40, 12
    logits, top_k, top_p, greedy, seeds, _ = random_rows(generator, batch, size, False, "cpu")
    top_k[:3] = torch.tensor([[CANDIDATE_TOP_K], [CANDIDATE_TOP_K + 1], [50_000]])
    order = logits[3].argsort(descending=True)
    logits[3, order[10:CANDIDATE_TOP_K + 40]] = float(logits[3, order[9]])  # ties past the candidates
    top_k[3] = 10
    window = torch.randint(0, size, (batch, width), generator=generator)
    window[::4, 5:] = window[::4, :1]  # short windows padded with their first id
    x = LLMStepInputs(
        token=torch.zeros(batch, dtype=torch.long), position=torch.zeros(batch, dtype=torch.long),
        active=torch.ones(batch, dtype=torch.bool),
        temperature=torch.where(greedy, 1.0, torch.rand(batch, generator=generator) * 1.9 + 0.05),
        top_p=top_p[:, 0], top_k=top_k[:, 0],
        penalty=torch.rand(batch, generator=generator) * 1.5 + 0.5, greedy=greedy, seed=seeds,
        counter=torch.randint(0, 4096, (batch,), generator=generator), window=window)
    x = LLMStepInputs(**{name: getattr(x, name).to(device) for name in x.__dataclass_fields__})
    logits = logits.to(device)
    full = sample_next_token(logits, x, "full")
    auto = sample_next_token(logits, x, "auto")
    fast = sample_next_token(logits, x, "candidates")
    assert torch.equal(auto, full)
    declined = (top_k[:, 0] > CANDIDATE_TOP_K) | (torch.arange(batch) == 3)
    assert torch.equal((fast < 0).cpu(), declined)
    assert torch.equal(fast[fast >= 0], full[fast >= 0])
    small = LLMStepInputs(**{name: getattr(x, name)[4:] for name in x.__dataclass_fields__})
    assert torch.equal(sample_next_token(logits[4:], small, "auto"), full[4:])
    with pytest.raises(ValueError):
        sample_next_token(logits, x, "fast")

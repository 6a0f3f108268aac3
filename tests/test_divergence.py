"""Tests of fsd_eagle.divergence against a plain float64 numpy reference (p = target, q = draft)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsd_eagle import divergence as divergence_module
from fsd_eagle.divergence import DIVERGENCES, divergence
from fsd_eagle.errors import ConfigError, InputError

LN2 = math.log(2.0)
NEG_INF = float("-inf")
LOG_FLOOR = -69.0  # the documented floor, written here independently of the module


# ---------------------------------------------------- float64 reference, one row at a time


def ref_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max()
    return shifted - math.log(np.exp(shifted).sum())


def ref_bins(
    lp: np.ndarray, lq: np.ndarray, kept: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The kept tokens plus a rest bin (rest summed directly from the non-kept probabilities)."""
    p, q = np.exp(lp), np.exp(lq)
    if kept is None:
        return p, q
    rest = np.setdiff1d(np.arange(len(p)), kept)
    # The kept set must be a valid top-k of p: nothing left out beats anything kept.
    assert len(set(kept.tolist())) == len(kept)
    if len(rest) and len(kept):
        assert p[kept].min() >= p[rest].max() - 1e-6  # float32 near-ties may order either way
    return (
        np.append(p[kept], p[rest].sum()),
        np.append(q[kept], q[rest].sum()),
    )


def ref_kl(a: np.ndarray, b: np.ndarray) -> float:
    """KL(a || b) with log-probs floored at LOG_FLOOR; terms with a == 0 are dropped."""
    total = 0.0
    for ai, bi in zip(a, b):
        if ai == 0.0:
            continue
        la = max(math.log(ai), LOG_FLOOR)
        lb = max(math.log(bi), LOG_FLOOR) if bi > 0.0 else LOG_FLOOR
        total += ai * (la - lb)
    return total


def ref_row(name: str, tl: np.ndarray, dl: np.ndarray, kept: np.ndarray | None) -> float:
    p, q = ref_bins(ref_log_softmax(tl), ref_log_softmax(dl), kept)
    m = 0.5 * (p + q)
    if name == "kl":
        return ref_kl(q, p)
    if name == "reverse_kl":
        return ref_kl(p, q)
    if name == "js":
        return 0.5 * ref_kl(p, m) + 0.5 * ref_kl(q, m)
    if name == "js_legacy":
        return 0.5 * ref_kl(m, p) + 0.5 * ref_kl(m, q)
    if name == "tv":
        return 0.5 * float(np.abs(p - q).sum())
    raise AssertionError(name)


def kept_indices(target: torch.Tensor, k: int) -> np.ndarray | None:
    """Top-k token ids of p. Ties (equal p, e.g. several -inf logits) may be broken either way,
    so take torch.topk's choice for them; ref_bins checks that the choice is a valid top-k."""
    if k == 0:
        return None
    k = min(k, target.shape[-1])
    return torch.topk(torch.log_softmax(target.float(), -1), k, dim=-1).indices.numpy()


def reference(name: str, target: torch.Tensor, draft: torch.Tensor, k: int = 0) -> np.ndarray:
    t = target.double().numpy()
    d = draft.double().numpy()
    kept = kept_indices(target, k)
    rows = [ref_row(name, t[i], d[i], None if kept is None else kept[i]) for i in range(len(t))]
    return np.array(rows)


def assert_matches(got: torch.Tensor, want: np.ndarray, tol: float = 1e-5) -> None:
    """|got - want| <= tol * max(1, |want|): absolute for small values, relative for large ones."""
    assert got.dtype == torch.float32
    assert got.shape == want.shape
    g = got.double().numpy()
    err = np.abs(g - want) / np.maximum(1.0, np.abs(want))
    assert err.max() <= tol, f"max scaled error {err.max():.3g}\ngot  {g}\nwant {want}"


def check_sane(name: str, out: torch.Tensor) -> None:
    assert torch.isfinite(out).all(), out
    assert (out >= 0).all(), out
    if name == "js":
        assert (out <= LN2).all(), out
    if name == "tv":
        assert (out <= 1.0).all(), out


# ---------------------------------------------------------------- input cases

V = 64


def case_random() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, V, generator=g) * 2, torch.randn(6, V, generator=g) * 2


def case_peaked() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    t = torch.randn(6, V, generator=g) * 20
    d = (t + torch.randn(6, V, generator=g)) * 1.0
    d[3:] = torch.randn(3, V, generator=g) * 20  # unrelated peaks too
    return t, d


def case_near_disjoint() -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.full((4, V), math.log(1e-12))
    d = torch.full((4, V), math.log(1e-12))
    for i in range(4):
        t[i, i] = 0.0
        d[i, V - 1 - i] = 0.0
    return t, d


def case_one_hot() -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.full((4, V), NEG_INF)
    d = torch.full((4, V), NEG_INF)
    t[0, 5] = d[0, 5] = 3.0  # identical one-hots
    t[1, 5], d[1, 7] = 0.0, 0.0  # different one-hots
    t[2, 0], d[2, :] = 1.0, torch.linspace(-2, 2, V)  # one-hot target, full draft
    t[3, :], d[3, 9] = torch.linspace(-2, 2, V), 0.0  # full target, one-hot draft
    return t, d


def case_filtered() -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k/top-p style -inf on part of the vocabulary, on different tokens for p and q."""
    g = torch.Generator().manual_seed(2)
    t = torch.randn(5, V, generator=g) * 3
    d = torch.randn(5, V, generator=g) * 3
    t[:, ::3] = NEG_INF
    d[:, 1::4] = NEG_INF
    d[4] = NEG_INF
    d[4, 0] = 0.0  # draft one-hot on a token the target filtered out
    return t, d


CASES = {
    "random": case_random,
    "peaked": case_peaked,
    "near_disjoint": case_near_disjoint,
    "one_hot": case_one_hot,
    "filtered": case_filtered,
}


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("k", [0, 1, 5, V - 1, V, V + 10])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", DIVERGENCES)
def test_matches_float64_reference(name: str, case: str, k: int) -> None:
    t, d = CASES[case]()
    out = divergence(name, t, d, support_top_k=k)
    check_sane(name, out)
    assert_matches(out, reference(name, t, d, k))


def test_constants() -> None:
    assert divergence_module.LOG_FLOOR == LOG_FLOOR
    assert DIVERGENCES == ("kl", "reverse_kl", "js", "js_legacy", "tv")


def test_reference_sanity() -> None:
    """The reference itself hits known closed forms, so a shared mistake cannot hide."""
    p, q = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    m = 0.5 * (p + q)
    assert ref_kl(p, m) == pytest.approx(LN2)
    assert 0.5 * ref_kl(p, m) + 0.5 * ref_kl(q, m) == pytest.approx(LN2)
    assert ref_kl(q, p) == pytest.approx(-LOG_FLOOR)  # floored +inf
    tl = np.log(np.array([0.5, 0.25, 0.25]))
    lp = ref_log_softmax(tl)
    assert np.allclose(ref_bins(lp, lp, np.array([0]))[0], [0.5, 0.5])
    with pytest.raises(AssertionError):  # token 1 is not a top-1 token of p
        ref_bins(lp, lp, np.array([1]))


def test_known_values() -> None:
    t = torch.tensor([[0.0, NEG_INF], [math.log(0.75), math.log(0.25)]])
    d = torch.tensor([[NEG_INF, 0.0], [math.log(0.25), math.log(0.75)]])
    assert divergence("js", t, d)[0].item() == pytest.approx(LN2, abs=1e-6)
    assert divergence("tv", t, d).tolist() == pytest.approx([1.0, 0.5], abs=1e-6)
    kl = 0.25 * math.log(0.25 / 0.75) + 0.75 * math.log(0.75 / 0.25)
    assert divergence("kl", t, d)[1].item() == pytest.approx(kl, abs=1e-6)
    assert divergence("kl", t, d)[0].item() == pytest.approx(-LOG_FLOOR, abs=1e-4)  # true +inf
    # js_legacy is unbounded: on disjoint one-hots KL(m || p) = 0.5 (-ln 2) + 0.5 (-ln 2 - floor).
    assert divergence("js_legacy", t, d)[0].item() == pytest.approx(-LOG_FLOOR / 2 - LN2, rel=1e-6)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("name", DIVERGENCES)
def test_identical_is_zero(name: str, k: int) -> None:
    for make in CASES.values():
        t, _ = make()
        out = divergence(name, t, t.clone(), support_top_k=k)
        check_sane(name, out)
        assert out.abs().max().item() <= 1e-6, (name, out)


def test_js_symmetric_and_bounded() -> None:
    for make in CASES.values():
        t, d = make()
        a, b = divergence("js", t, d), divergence("js", d, t)
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
        assert (a <= LN2).all()


def test_asymmetric_pair() -> None:
    t, d = case_random()
    assert torch.allclose(divergence("kl", t, d), divergence("reverse_kl", d, t), atol=1e-6)
    assert not torch.allclose(divergence("kl", t, d), divergence("reverse_kl", t, d), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes(dtype: torch.dtype) -> None:
    t, d = case_filtered()
    t, d = t.to(dtype), d.to(dtype)
    for name in DIVERGENCES:
        out = divergence(name, t, d, support_top_k=4)
        check_sane(name, out)
        assert_matches(out, reference(name, t, d, 4))


def test_no_host_sync_fixed_shapes() -> None:
    """Meta tensors have no values: any .item()/.tolist() or value-dependent branch would fail."""
    t = torch.empty(7, 100, device="meta")
    for name in DIVERGENCES:
        for k in (0, 10):
            out = divergence(name, t, t, support_top_k=k)
            assert out.shape == (7,) and out.dtype == torch.float32 and out.device.type == "meta"


def test_errors() -> None:
    t, d = case_random()
    with pytest.raises(ConfigError, match="unknown divergence 'jsd'"):
        divergence("jsd", t, d)
    with pytest.raises(ConfigError, match="support_top_k"):
        divergence("kl", t, d, support_top_k=-1)
    with pytest.raises(ConfigError, match="support_top_k"):
        divergence("kl", t, d, support_top_k=2.0)  # type: ignore[arg-type]
    with pytest.raises(InputError):
        divergence("kl", t, d[:, :-1])


# ---------------------------------------------------------------- property test

_logit = st.one_of(
    st.floats(-30.0, 30.0, allow_nan=False, width=32),
    st.just(NEG_INF),
)


@st.composite
def logit_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, int]:
    m = draw(st.integers(1, 4))
    v = draw(st.integers(1, 12))
    rows = st.lists(_logit, min_size=v, max_size=v).filter(lambda r: any(x != NEG_INF for x in r))
    t = torch.tensor(draw(st.lists(rows, min_size=m, max_size=m)), dtype=torch.float32)
    d = torch.tensor(draw(st.lists(rows, min_size=m, max_size=m)), dtype=torch.float32)
    return t, d, draw(st.integers(0, v + 2))


@settings(max_examples=60, deadline=None)
@given(logit_pairs())
def test_property_random_logits(args: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    t, d, k = args
    for name in DIVERGENCES:
        out = divergence(name, t, d, support_top_k=k)
        check_sane(name, out)
        assert_matches(out, reference(name, t, d, k), tol=2e-5)


def test_names_match_the_authors_kl_div_calls():
    """docs/divergences.md: torch's kl_div(input=log b, target=a) is KL(a || b), so the FSD authors'
    'kl_div' = kl_div(log p, q) is our kl, 'kl_div_reversed' = kl_div(log q, p) our reverse_kl, and
    'js_div' = 0.5 kl_div(log p, m) + 0.5 kl_div(log q, m) our js_legacy (not js)."""
    g = torch.Generator().manual_seed(0)
    tl, dl = torch.randn(6, 11, generator=g) * 2, torch.randn(6, 11, generator=g) * 2
    p, q = tl.softmax(-1), dl.softmax(-1)
    m = 0.5 * (p + q)
    kl_div = torch.nn.functional.kl_div
    theirs = {
        "kl": kl_div(p.log(), q, reduction="none").sum(-1),
        "reverse_kl": kl_div(q.log(), p, reduction="none").sum(-1),
        "js_legacy": (0.5 * kl_div(p.log(), m, reduction="none") + 0.5 * kl_div(q.log(), m, reduction="none")).sum(-1),
        "tv": 0.5 * (p - q).abs().sum(-1),
    }
    for name, ref in theirs.items():
        torch.testing.assert_close(divergence(name, tl, dl), ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(divergence("js", tl, dl), theirs["js_legacy"], rtol=1e-3)

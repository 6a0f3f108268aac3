"""How much a node's children are accepted when sampling at temperature T: the children the tree drafts now
(the head's top k, a deterministic set) against k children sampled without replacement from the head's
distribution at T, each verified by its lossless rule. Measured teacher-forced along the target's own samples
at T (MT-bench first turns), position by position:

* deterministic top-k: recursive rejection with point-mass proposals accepts the set with probability
  sum_{x in top-k} p_T(x) (``deterministic_acceptance``; this is what the verifier does today);
* sampled children: k candidates drawn one after the other without replacement from r = q_T, candidate i
  accepted with probability min(1, p_i(x_i) / r_i(x_i)), on rejection p_{i+1} = norm(max(p_i - r_i, 0)) and
  r_{i+1} = r_i without x_i, renormalised (recursive rejection sampling without replacement; the output is
  distributed as p_T). Its acceptance is estimated by Monte Carlo (``sampled_acceptance``);
* with ``--truncate M,...``: the same children drawn from the head's top M tokens only (r = q_T restricted to
  them, renormalised; ``truncated``). Any proposal keeps the rule lossless, and a proposal of M tokens lets a
  verifier's rejection states be sums over M tokens instead of the vocabulary.

    python -m eval.multidraft --temperature 0.7 --prompts 8 --positions 300 --out runs/multidraft_cpu.json

The head may be EAGLE-2-style (it predicts the target's next feature; the target's lm_head gives q) or
EAGLE-3 (it reads the captured target layers and drafts over its own vocabulary; q is -inf off it).

A per-level comparison only: a whole tree compounds the levels' acceptance along its paths.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from fsd_eagle.errors import InputError
from fsd_eagle.jsonl import write_text_atomic
from training.features import target_features

KS = (1, 2, 4, 8)


def deterministic_acceptance(p: torch.Tensor, q_logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: the probability that the lossless rule accepts one of the head's top-``k`` tokens (by
    ``q_logits`` ``[N, V]``) when the target samples from ``p`` ``[N, V]``: their total mass under p."""
    return p.gather(1, q_logits.topk(k, dim=-1).indices).sum(1)


def rrsw(p: torch.Tensor, r: torch.Tensor, k: int, draws: int, generator: torch.Generator | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling without replacement, ``draws`` times for one position: target
    distribution ``p`` ``[V]``, proposal ``r`` ``[V]``, ``k`` candidates. Returns (accepted ``[draws]``
    bool, the token output ``[draws]``: the accepted candidate, else a sample of the final residual), whose
    distribution is ``p``."""
    pi = p.expand(draws, -1).clone()
    ri = r.expand(draws, -1).clone()
    accepted = torch.zeros(draws, dtype=torch.bool)
    out = torch.zeros(draws, dtype=torch.long)
    for _ in range(k):
        live = ri.sum(1) > 0  # a proposal with nothing left proposes nothing more
        x = torch.multinomial(torch.where(live[:, None], ri, 1.0), 1, generator=generator).squeeze(1)
        px, rx = pi.gather(1, x[:, None]).squeeze(1), ri.gather(1, x[:, None]).squeeze(1)
        u = torch.rand(draws, generator=generator)
        take = live & ~accepted & (u * rx < px)
        out = torch.where(take, x, out)
        accepted |= take
        residual = torch.clamp(pi - ri, min=0)
        # rows still rejecting move to the residual (it has mass: p = r would have been accepted)
        update = (live & ~accepted)[:, None]
        pi = torch.where(update, residual / residual.sum(1, keepdim=True).clamp(min=1e-30), pi)
        ri = torch.where(live[:, None], ri.scatter(1, x[:, None], 0.0), ri)
        ri = ri / ri.sum(1, keepdim=True).clamp(min=1e-30)
    rest = torch.multinomial(pi, 1, generator=generator).squeeze(1)
    return accepted, torch.where(accepted, out, rest)


def sampled_acceptance(p: torch.Tensor, r: torch.Tensor, k: int, draws: int = 64,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """Per row of ``p`` and ``r`` ``[N, V]``: the Monte Carlo estimate (``draws`` runs) of the probability
    that one of ``k`` children sampled without replacement from r is accepted."""
    return torch.stack([rrsw(p[i], r[i], k, draws, generator)[0].float().mean() for i in range(p.shape[0])])


def teacher_forced(model, tokenizer, head, prompts: list[str], temperature: float, new_tokens: int, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and head logits ``[N, V]`` at every answer position of the target's own answers sampled at
    ``temperature``: the head reads the target's features up to the position before (EAGLE-2 drafting's
    first level). An EAGLE-3 head's logits are -inf off its draft vocabulary."""
    from fsd_eagle.drafter import EagleDrafter
    from fsd_eagle.target import Target

    target = Target(model)
    drafter = EagleDrafter(head, target)  # its draft logits over every token (-inf off an EAGLE-3 vocabulary)
    drafter.use_vocab(0)
    layers = head.config.layers if head.config.eagle3 else ()
    torch.manual_seed(seed)
    ps, qs = [], []
    for text in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        ids = torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)], device=model.device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=new_tokens)
            f, states = target_features(target, out, torch.ones_like(out, dtype=torch.bool), layers)
            features = states if layers else f
            pred = head.unroll(target.embed(out[:, 1:]), features[:, :-1], 1)[0]  # row t: x_{t+2}'s draft
            t = torch.arange(ids.shape[1] - 2, out.shape[1] - 2, device=out.device)
            ps.append(target.logits(f[0, t + 1]).float())
            qs.append(drafter.logits(pred[0, t], full=True).float())
    return torch.cat(ps), torch.cat(qs)


def truncated(r: torch.Tensor, m: int) -> torch.Tensor:
    """``r`` ``[N, V]`` restricted to each row's ``m`` most likely tokens, renormalised."""
    top = r.topk(m, dim=-1)
    kept = torch.zeros_like(r).scatter(1, top.indices, top.values)
    return kept / kept.sum(1, keepdim=True)


def lumped(p: torch.Tensor, q_logits: torch.Tensor, m: int, proposal_temperature: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's top m tokens of each row as m + 1 entries ``[N, m + 1]``: p on them and the target's mass
    on every other token as one entry; the proposal softmax(q / proposal_temperature) restricted to them
    and renormalised (0 on the last entry). Recursive rejection reads p off the proposal's support only
    through its total (there r = 0 and p - r = p), so children drawn from the top m are accepted exactly as
    often as over the whole vocabulary, at a sum over m + 1 entries per step."""
    top = q_logits.topk(m, dim=-1)
    p_top = p.gather(1, top.indices)
    r = torch.softmax(top.values / proposal_temperature, -1)
    return (torch.cat([p_top, (1 - p_top.sum(1, keepdim=True)).clamp(min=0)], 1),
            torch.cat([r, torch.zeros_like(r[:, :1])], 1))


def measure(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float, positions: int, draws: int,
            seed: int, truncate: tuple[int, ...] = (), proposal_temperatures: tuple[float, ...] = (),
            whole: bool = True) -> dict:
    """Mean acceptance per k, deterministic and sampled (from the head's whole distribution, and from its
    top m for each m in ``truncate``: ``sampled_{k}_top{m}``, k <= m), on ``positions`` rows chosen at
    random (the same rows for all). The proposal is the head at ``temperature``; each of
    ``proposal_temperatures`` adds the children from the top m drawn at that temperature instead
    (``sampled_{k}_top{m}_t{T}``; the rule stays lossless whatever the proposal). ``whole``: False skips the
    children from the whole distribution (``sampled_{k}``: each draw a pass over the vocabulary, the bulk
    of the time)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(p_logits.shape[0], generator=g)[:positions]
    p = torch.softmax(p_logits[rows] / temperature, -1)
    r = torch.softmax(q_logits[rows] / temperature, -1)
    out = {"positions": int(rows.numel()), "draws": draws}
    proposals = [(temperature, "")] + [(t, f"_t{t:g}") for t in proposal_temperatures]
    pools = {(m, suffix): lumped(p, q_logits[rows], m, t) for m in truncate for t, suffix in proposals}
    for k in KS:
        out[f"deterministic_{k}"] = round(float(deterministic_acceptance(p, q_logits[rows], k).mean()), 4)
        if whole:
            out[f"sampled_{k}"] = round(float(sampled_acceptance(p, r, k, draws, g).mean()), 4)
        for m in (m for m in truncate if m >= k):
            for _, suffix in proposals:
                out[f"sampled_{k}_top{m}{suffix}"] = round(float(
                    sampled_acceptance(*pools[m, suffix], k, draws, g).mean()), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    from fsd_eagle.cli import OneLineParser, quiet_transformers
    from fsd_eagle.models import default_head_path, load_head, load_target

    from .runinfo import git_commit, versions
    from .tasks import load_mt_bench

    ap = OneLineParser(prog="python -m eval.multidraft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--prompts", type=int, default=8, help="MT-bench first turns, spread over the 80")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--positions", type=int, default=300, help="answer positions measured (at random)")
    ap.add_argument("--draws", type=int, default=64, help="Monte Carlo runs per position")
    ap.add_argument("--truncate", default="", help="comma-separated m: also children sampled from the head's top m "
                    "tokens only (e.g. 16,32,64)")
    ap.add_argument("--proposal-temperatures", default="",
                    help="comma-separated: also children from the top m (--truncate) drawn at these temperatures")
    ap.add_argument("--no-whole", action="store_true",
                    help="skip children from the head's whole distribution (the slow part); pools only")
    ap.add_argument("--head", help="head folder (default: the shipped head)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not a.temperature > 0:
        raise InputError("--temperature must be > 0 (greedy decoding has no sampled children)")
    if min(a.prompts, a.new_tokens, a.positions, a.draws) < 1:
        raise InputError("--prompts, --new-tokens, --positions and --draws must be >= 1")
    try:
        truncate = tuple(int(m) for m in a.truncate.split(",") if m.strip())
    except ValueError:
        raise InputError(f"--truncate takes whole numbers separated by commas, got {a.truncate!r}") from None
    if any(m < 1 for m in truncate):
        raise InputError("--truncate sizes must be >= 1")
    try:
        proposal_temperatures = tuple(float(x) for x in a.proposal_temperatures.split(",") if x.strip())
    except ValueError:
        raise InputError(f"--proposal-temperatures takes numbers separated by commas, got "
                         f"{a.proposal_temperatures!r}") from None
    if any(not t > 0 for t in proposal_temperatures) or (proposal_temperatures and not truncate):
        raise InputError("--proposal-temperatures must be > 0, and need --truncate (the pools they draw from)")
    quiet_transformers()
    device = torch.device("cpu")
    model, tokenizer = load_target(None, device, torch.float32)
    head_dir = a.head or default_head_path("SmolLM2-135M-Instruct")
    head = load_head(head_dir, model.config, device, torch.float32).eval()
    questions = load_mt_bench()
    chosen = questions[:: max(1, len(questions) // a.prompts)][: a.prompts]
    t = time.perf_counter()
    p_logits, q_logits = teacher_forced(model, tokenizer, head, [q.turns[0] for q in chosen], a.temperature,
                                        a.new_tokens, a.seed)
    result = {"temperature": a.temperature, "prompts": len(chosen), "answer_positions": int(p_logits.shape[0]),
              **measure(p_logits, q_logits, a.temperature, a.positions, a.draws, a.seed, truncate,
                        proposal_temperatures, whole=not a.no_whole),
              "head": a.head or "the shipped head (fsd_eagle/heads/SmolLM2-135M-Instruct)",
              "device": f"cpu ({platform.machine()})", **versions(), "commit": git_commit(short=True),
              "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - t, 1),
              "command": "python -m eval.multidraft " + " ".join(sys.argv[1:] if argv is None else argv)}
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        write_text_atomic(Path(a.out), text + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

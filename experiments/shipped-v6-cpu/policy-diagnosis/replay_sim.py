"""Replay greedy DSpark decoding at batch 1 from replay_build's per-anchor acceptance and confidences, under any
policy, priced by the quiet cost table (+ measured per-round overheads). Exact for greedy: the tokens do not depend
on the policy, and neither does the block drafted at an anchor."""
import json, sys, glob, os, importlib
import torch
from dspark_hf.costs.profile import EngineCosts
from dspark_hf.scheduling import FixedLength, FullBlock
import dspark_hf.scheduling.auto as auto_mod

O_PLAIN, O_NODRAFT, O_DRAFT = 0.0005, 0.0015, 0.0035


def table():
    # the cost cache's file for this CPU, kept beside the scripts (it ran from ~/.cache/dspark_hf/profiles/)
    d = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "costs.json")))
    v = {int(R): {int(n): s for n, s in row.items()} for R, row in d["verify"].items()}
    dr = {int(R): s for R, s in next(iter(d["drafts"].values())).items()}
    return EngineCosts(v, dr)


def replay(rows, make_policy, costs, carry=True):
    policy = make_policy()
    total = plain = 0.0
    rounds = drafted = 0
    for i, row in enumerate(rows):
        if hasattr(policy, "costs"):
            policy.costs = costs
            if policy.learned is None or not carry:
                policy.learned = policy.fresh(7)
        N, acc, conf = row["new"], row["accepted"], torch.tensor(row["confidences"])
        plain += N * (costs.verify(1, 1) + O_PLAIN)
        q, gen = 0, 1  # anchor index into the new tokens; tokens generated (the first from the prefill)
        while gen < N:
            rounds += 1
            remaining = N - gen
            if remaining > 1 and policy.draft_this_round(1):
                L = int(policy(conf[q][None], 7, 1)[0])
                L = min(L, remaining - 1)
                n = min(acc[q], L)
                policy.observe(torch.tensor([L]), torch.tensor([n]), drafted=True)
                total += costs.draft(1) + costs.verify(1, 1 + L) + O_DRAFT
                drafted += 1
            else:
                if remaining > 1:
                    policy.observe(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), drafted=False)
                n = 0
                total += costs.verify(1, 1) + O_NODRAFT
            gen += n + 1
            q += n + 1
    return plain / total, rounds, drafted


if __name__ == "__main__":
    costs = table()
    rows = json.load(open(sys.argv[1]))
    pols = {"auto": lambda: auto_mod.AutoScheduled(progress=False), "full": FullBlock}
    for k in (1, 2, 3):
        pols[f"fixed {k}"] = (lambda k=k: FixedLength(k))
    for name, make in pols.items():
        r, rounds, drafted = replay(rows, make, costs)
        print(f"{name:8s} {r:.3f}x rounds {rounds} drafted {drafted} ({drafted / rounds:.0%})")

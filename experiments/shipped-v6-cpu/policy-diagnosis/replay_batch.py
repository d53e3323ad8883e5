"""Batched replay: rows of a batch share rounds (the policy decides per round; each row verifies its own length;
the round costs t_draft(R) + t_verify(R, 1 + longest)); finished rows leave the batch. Plain: the batch decodes
until its longest row ends."""
import os, sys, json, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from replay_sim import table, O_PLAIN, O_NODRAFT, O_DRAFT
from dspark_hf.scheduling import FixedLength, FullBlock
from dspark_hf.scheduling.auto import AutoScheduled


def replay_batch(rows, B, make_policy, costs):
    policy = make_policy()
    total = plain = 0.0
    rounds = drafted = 0
    for start in range(0, len(rows), B):
        batch = rows[start:start + B]
        if hasattr(policy, "costs"):
            policy.costs = costs
            if policy.learned is None:
                policy.learned = policy.fresh(7)
        R0 = len(batch)
        plain += max(r["new"] for r in batch) * (costs.verify(R0, 1) + O_PLAIN)
        q = [0] * R0; gen = [1] * R0
        while True:
            alive = [i for i in range(R0) if gen[i] < batch[i]["new"]]
            if not alive:
                break
            R = len(alive); rounds += 1
            remaining = torch.tensor([batch[i]["new"] - gen[i] for i in alive])
            if bool((remaining > 1).any()) and policy.draft_this_round(R):
                conf = torch.stack([torch.tensor(batch[i]["confidences"][q[i]]) for i in alive])
                L = torch.minimum(policy(conf, 7, R).cpu(), remaining - 1).clamp_min(0)
                n = torch.tensor([min(batch[i]["accepted"][q[i]], int(l)) for i, l in zip(alive, L)])
                policy.observe(L, n, drafted=True)
                total += costs.draft(R) + costs.verify(R, 1 + int(L.max())) + O_DRAFT * (1 + 0.1 * R)
                drafted += 1
            else:
                n = torch.zeros(R, dtype=torch.long)
                policy.observe(n, n, drafted=False)
                total += costs.verify(R, 1) + O_NODRAFT * (1 + 0.1 * R)
            for i, k in zip(alive, n.tolist()):
                gen[i] += k + 1; q[i] += k + 1
    return plain / total, rounds, drafted


if __name__ == "__main__":
    costs = table(); rows = json.load(open(sys.argv[1])); B = int(sys.argv[2])
    pols = {"auto .3": lambda: AutoScheduled(progress=False, smoothing=0.3),
            "auto .1": lambda: AutoScheduled(progress=False, smoothing=0.1), "full": FullBlock}
    for k in (1, 2, 3):
        pols[f"fixed {k}"] = (lambda k=k: FixedLength(k))
    for name, make in pols.items():
        r, rounds, drafted = replay_batch(rows, B, make, costs)
        print(f"  {name:10s} {r:.3f}x rounds {rounds} drafted {drafted / rounds:.0%}")

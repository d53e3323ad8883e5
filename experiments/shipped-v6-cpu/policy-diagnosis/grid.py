import os, sys, json
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from replay_sim import replay, table
from variants import LossFloor
from dspark_hf.scheduling import FixedLength, FullBlock
from dspark_hf.scheduling.auto import AutoScheduled
costs = table()
for path in sys.argv[1:]:
    rows = json.load(open(path))
    print(path)
    res = []
    for k in (1, 2, 3):
        res.append((f"fixed {k}", replay(rows, lambda k=k: FixedLength(k), costs)))
    res.append(("full", replay(rows, FullBlock, costs)))
    for sm in (0.3, 0.1, 0.05, 0.02):
        for cls in (AutoScheduled, LossFloor):
            for budget in (0.02, 0.05):
                res.append((f"{cls.__name__[:6]} sm{sm} b{budget}",
                            replay(rows, lambda: cls(progress=False, smoothing=sm, probe_budget=budget), costs)))
    for name, (r, rounds, drafted) in res:
        print(f"  {name:24s} {r:.3f}x drafted {drafted / rounds:.0%}")

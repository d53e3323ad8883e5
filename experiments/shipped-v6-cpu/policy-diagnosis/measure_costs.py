import sys, time, torch
import dspark_hf
from dspark_hf.costs.profile import cached_costs
target, tok = dspark_hf.default_target()
drafts = {"new": dspark_hf.default_draft(target)}
if len(sys.argv) > 1:
    drafts["old"] = dspark_hf.DSparkDraftModel.from_pretrained(
        sys.argv[1], dtype=dspark_hf.fast_draft_dtype(target)).bind_target(target).eval()
print("threads", torch.get_num_threads())
for name, d in drafts.items():
    t = time.time()
    c = cached_costs(target, d, [1, 8], progress=False)
    print(name, "measured in", round(time.time() - t, 1), "s")
    for R in (1, 8):
        print(name, "R", R, "verify ms", [round(c.verify(R, n) * 1000, 1) for n in range(1, 9)],
              "draft", round(c.draft(R) * 1000, 1))

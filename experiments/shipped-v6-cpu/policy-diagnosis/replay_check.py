import json, sys, torch, dspark_hf
from dspark_hf import FullBlock
from dspark_hf.evaluation.suites import load_prompts
from dspark_hf.evaluation.evaluate import chat_batch
torch.set_num_threads(1)
rows = json.load(open(sys.argv[1]))
target, tok = dspark_hf.default_target(); draft = dspark_hf.default_draft(target)
for p, row in list(zip(load_prompts(None, ["humaneval", "mtbench", "gsm"], 3), rows))[:2]:
    enc = chat_batch(tok, [p], "cpu")
    out = target.generate(**enc, assistant_model=draft, max_new_tokens=96, do_sample=False,
                          verification_policy=FullBlock(), return_dict_in_generate=True)
    q = 0; bad = 0; cd = 0.0
    for r in out.rounds[0]:
        if not r.drafted: break
        if r.accepted != min(row["accepted"][q], r.verified): bad += 1
        cd = max(cd, max(abs(a - b) for a, b in zip(r.confidences, row["confidences"][q])))
        q += r.accepted + 1
    print(p["id"], "rounds", len(out.rounds[0]), "mismatched accepted", bad, "max conf diff", round(cd, 4))
p, row = load_prompts(None, ["humaneval"], 1)[0], rows[0]
enc = chat_batch(tok, [p], "cpu")
out = target.generate(**enc, assistant_model=draft, max_new_tokens=96, do_sample=False,
                      verification_policy=FullBlock(), return_dict_in_generate=True)
q = 0
for r in out.rounds[0][:6]:
    print(q, r.accepted, row["accepted"][q], [round(c, 2) for c in r.confidences[:4]],
          [round(c, 2) for c in row["confidences"][q][:4]])
    q += r.accepted + 1

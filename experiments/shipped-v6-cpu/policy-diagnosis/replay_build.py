"""For each prompt: plain greedy output, and at every anchor the draft's block acceptance a(q) and confidences c(q)
(exactly what DSpark decoding would see there: greedy output is plain generate()'s whatever the policy)."""
import sys, json, torch
import dspark_hf
from dspark_hf.evaluation.suites import load_prompts
from dspark_hf.evaluation.evaluate import chat_batch
from dspark_hf.generation.block_sources import sample_block

torch.set_num_threads(1)
out_path, draft_dir, limit, N = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
suites = sys.argv[5].split(",") if len(sys.argv) > 5 else ["humaneval", "mtbench", "gsm"]
target, tok = dspark_hf.default_target()
draft = dspark_hf.default_draft(target) if draft_dir == "new" else dspark_hf.DSparkDraftModel.from_pretrained(
    draft_dir, dtype=dspark_hf.fast_draft_dtype(target)).bind_target(target).eval()
rows = []
for p in load_prompts(None, suites, limit):
    enc = chat_batch(tok, [p], "cpu")
    P = enc["input_ids"].shape[1]
    seq = target.generate(**enc, max_new_tokens=N, do_sample=False)[0]
    with torch.no_grad():
        out = target(input_ids=seq[None], use_cache=False, output_hidden_states=draft.hidden_states_request)
    T = seq.shape[0]
    positions = torch.arange(T)[None]
    ctx = draft.encode_context(draft.target_features(out.hidden_states), positions, torch.ones(1, T, dtype=torch.bool))
    anchors = torch.arange(P, T)[None]  # every new token can be an anchor
    block = sample_block(draft, seq[anchors], anchors, ctx, False)
    toks, conf = block.tokens[0], block.confidences[0]
    acc = []
    for j, q in enumerate(range(P, T)):
        nxt = seq[q + 1:q + 1 + toks.shape[1]]
        m = 0
        while m < nxt.shape[0] and int(toks[j, m]) == int(nxt[m]):
            m += 1
        acc.append(m)
    rows.append({"id": p["id"], "domain": p.get("domain"), "new": T - P, "accepted": acc,
                 "confidences": conf.float().tolist()})
    print(p["id"], T - P, sum(acc) / len(acc), flush=True)
json.dump(rows, open(out_path, "w"))

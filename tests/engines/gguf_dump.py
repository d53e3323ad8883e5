"""Read a GGUF file with llama.cpp's own reader (the gguf-py vendored beside its converter, which knows the DSpark
keys the PyPI release lacks) and write its keys and tensors as JSON: run by tests/test_engines.py in a subprocess,
so that the vendored gguf never shadows an installed one.

usage: python gguf_dump.py LLAMA_CPP_DIR FILE.gguf OUTPUT.json
OUTPUT.json: {"keys": {name: value} (tokenizer vocabularies left out), "tensors": {name: {"shape": [...], "type":
"F16", "head": its first 256 values in GGUF's order, "sum": the sum of all of them}}}
"""

import json
import sys


def main(llama_cpp: str, path: str, output: str) -> None:
    sys.path.insert(0, f"{llama_cpp}/gguf-py")
    from gguf import GGUFReader

    reader = GGUFReader(path)
    keys = {}
    for name, field in reader.fields.items():
        vocabulary = name.startswith("tokenizer.ggml.") and name != "tokenizer.ggml.mask_token_id"
        if vocabulary or name == "tokenizer.chat_template":
            continue
        try:
            keys[name] = field.contents()
        except Exception:  # a key whose type the reader cannot render: its presence is what counts
            keys[name] = None
    tensors = {t.name: {"shape": [int(n) for n in t.shape], "type": t.tensor_type.name,
                        "head": t.data.reshape(-1)[:256].tolist(), "sum": float(t.data.astype("float64").sum())}
               for t in reader.tensors}
    with open(output, "w") as f:
        json.dump({"keys": keys, "tensors": tensors}, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])

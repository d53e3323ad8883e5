"""Load a `dspark export --format speculators` folder with speculators' own code (0.9.0) and write what its modules
compute for fixed anchors: run by tests/test_engines.py in a subprocess, because speculators imports modules it
never uses here (openai, datasets, hs_connectors: stubbed below) and pins transformers <= 5.19, which we do not
install (it is installed with --no-deps; its modules run on our transformers).

usage: python speculators_check.py EXPORT INPUTS.pt OUTPUT.pt
INPUTS.pt: {"features": (1, T, K * H) target features of every position, "ids": (1, T), "anchors": (A,)}
OUTPUT.pt: {"logits": (A, gamma, V_draft), "confidence_logits": (A, gamma) or None, "missing": [...],
            "unexpected": [...], "config": the config speculators read, as a dict}
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty packages for what speculators imports at load time but this check never calls."""

    ROOTS = {"openai", "datasets", "hs_connectors"}

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: (_ for _ in ()).throw(AttributeError(attr)) if attr.startswith("__") \
            else type(attr, (), {})
        return module

    def exec_module(self, module):
        pass


def main(export: str, inputs: str, output: str) -> None:
    sys.meta_path.append(_Stubs())
    import torch
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core
    from speculators.losses import eager
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    x = torch.load(inputs)
    config = DSparkSpeculatorConfig.from_pretrained(export)
    config.transformer_layer_config._attn_implementation = "eager"  # its flex-attention mask compiles, CUDA only
    # as a user loads it (output_loading_info would skip its reload of the verifier's embedding and LM head)
    model = DSparkDraftModel.from_pretrained(export, config=config, dtype=torch.float32).eval()
    from safetensors import safe_open

    with safe_open(f"{export}/model.safetensors", "pt") as f:
        written = set(f.keys())
    own = set(model.state_dict())
    anchors = x["anchors"]
    # its training forward draws anchors at random and returns only losses: fix the anchors, capture the logits
    dflash_core.select_anchors = lambda loss_mask, n, block: (anchors, torch.ones(len(anchors), dtype=torch.bool))
    captured = {}

    def capture(logits, targets, confidence_logits, *args, **kwargs):
        captured.update(logits=logits, confidence_logits=confidence_logits)
        return torch.zeros(()), {}

    dspark_core.compute_metrics = capture
    T = x["ids"].shape[1]
    with torch.no_grad():
        model(hidden_states=x["features"], input_ids=x["ids"], loss_mask=torch.ones(1, T),
              verifier_last_hidden_states=torch.zeros(1, T, config.transformer_layer_config.hidden_size),
              document_ids=torch.zeros(1, T, dtype=torch.long), max_anchors=len(anchors), tv_loss_fn=eager.tv_loss)
    A, gamma = len(anchors), config.block_size
    conf = captured["confidence_logits"]
    torch.save({"logits": captured["logits"].view(A, gamma, -1), "confidence_logits": None if conf is None
                else conf.view(A, gamma), "missing": sorted(own - written),
                "unexpected": sorted(written - own), "config": config.to_dict()}, output)


if __name__ == "__main__":
    main(*sys.argv[1:])

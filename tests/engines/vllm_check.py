"""vLLM's own reader of a speculators-layout DSpark checkpoint, run on an export: `SpeculatorsConfig` (vllm 0.33.0,
transformers_utils/configs/speculators/base.py and algos.py's `update_dspark`), as vLLM calls it when it loads the
draft. It runs from the Python files of the vllm wheel (PYTHONPATH; these modules need neither its compiled kernels
nor a GPU).

    PYTHONPATH=<vllm files> python vllm_check.py EXPORT OUT.json

Writes the speculative config vLLM builds and the fields of the draft config it builds that its DSpark model
(model_executor/models/qwen3_dspark.py) reads."""

import json
import sys

from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

FIELDS = ("architectures", "model_type", "target_layer_ids", "eagle_aux_hidden_state_layer_ids", "sample_from_anchor",
          "dspark_bonus_anchor", "draft_vocab_size", "vocab_size", "target_hidden_size", "mask_token_id",
          "markov_rank", "markov_head_type", "block_size", "enable_confidence_head", "confidence_head_with_markov",
          "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "rms_norm_eps")

export, out = sys.argv[1:3]
config_dict, _ = SpeculatorsConfig.get_config_dict(export)
config = SpeculatorsConfig.from_pretrained(export)
layers = config_dict["transformer_layer_config"]
with open(out, "w") as f:
    json.dump({"speculative": SpeculatorsConfig.extract_vllm_speculative_config(config_dict),
               "draft": {name: getattr(config, name, None) for name in FIELDS},
               "layers_model_type": layers.get("model_type")}, f)

"""Sharing DSpark drafts on the Hugging Face Hub: a model card on every save, `push_to_hub`, `push_draft` (what
`dspark push` runs) and `export_draft` (what `dspark export` runs for the transformers format).

`DSparkDraftModel.save_pretrained` and `push_to_hub` hand over to [`save_pretrained`] and [`push_to_hub`] here
(and `from_pretrained` to [`offline_load_error`]) wherever this package is loaded, which `import dspark_hf` does: the
model looks it up by name (`dspark_hf.model.binding.sharing`); nothing sets it on the model. They live here, not in
model/, because the model's files are copied next to saved weights for ``trust_remote_code`` loading where dspark_hf
may not be installed: there it saves and pushes as plain transformers does (no card). The model never imports this
package; this package imports the model. Downloading needs nothing from us:
``DSparkDraftModel.from_pretrained(repo_id, revision=..., token=..., cache_dir=...)`` is transformers' own, with the
Hub cache, ``HF_HUB_OFFLINE=1`` and private repos.

One job a module:
- `sharing`: the hand-over itself (save with a card, push what was saved, the offline load's error). transformers'
  own `push_to_hub` would replace our card with its generic one (it writes README.md after `save_pretrained`), so
  ours saves into a temporary folder and commits exactly what `save_pretrained` wrote;
- `commands`: what `dspark push` and `dspark export` run on a draft folder, and reading the result files a card
  shows;
- `options`: those commands' flags.
"""

from .commands import export_draft, folder_calibration, push_draft, read_json
from .options import ExportOptions, PushOptions
from .sharing import (card_data_for, connection_errors, offline_load_error, push_to_hub, save_pretrained,
                      unreachable_hub_error, write_model_card)

__all__ = ["save_pretrained", "push_to_hub", "offline_load_error", "write_model_card", "card_data_for",
           "connection_errors", "unreachable_hub_error", "push_draft", "export_draft", "read_json",
           "folder_calibration", "PushOptions", "ExportOptions"]

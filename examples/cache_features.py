"""Cache the embedded target's features for a dataset once, before several trainings share the cache.

    python examples/cache_features.py DATASET CACHE_DIR LAYER_ID...

Examples already in CACHE_DIR are not recomputed, so the cache of a dataset extends to a larger one that contains it.
"""

import sys

from dspark_hf import default_target
from dspark_hf.training.data import load_dataset
from dspark_hf.training.features import CachedFeatures

if len(sys.argv) < 4:
    sys.exit(__doc__)
dataset, cache_dir, layer_ids = sys.argv[1], sys.argv[2], [int(i) for i in sys.argv[3:]]
target, _ = default_target()
examples = load_dataset(dataset, target.get_output_embeddings().weight.shape[0])
CachedFeatures(cache_dir, target, layer_ids, examples)

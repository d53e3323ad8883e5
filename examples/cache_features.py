"""Cache the embedded target's features for a dataset once, before several trainings share the cache.

    python examples/cache_features.py DATASET CACHE_DIR LAYER_ID...

Examples already in CACHE_DIR are not recomputed, so the cache of a dataset extends to a larger one that contains it.
"""

import argparse
import sys

from dspark_hf import default_target
from dspark_hf.training.data import load_dataset
from dspark_hf.training.features import CachedFeatures

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("dataset", help="a dataset written by `dspark prepare-data`")
parser.add_argument("cache_dir", help="the cache folder (`dspark train --feature-cache`)")
parser.add_argument("layer_ids", type=int, nargs="+", metavar="LAYER_ID", help="target layers to cache")
args = parser.parse_args()

target, _ = default_target()
try:
    examples = load_dataset(args.dataset, target.get_output_embeddings().weight.shape[0])
    CachedFeatures(args.cache_dir, target, args.layer_ids, examples)
except ValueError as error:  # bad layer ids, a bad dataset, a cache built for other layers
    sys.exit(f"cache_features.py: error: {error}")

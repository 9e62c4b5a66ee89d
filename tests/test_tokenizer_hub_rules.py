"""Boundaries and messages of the tokenizer's and the Hub resolver's rules (mutation audit)."""

from __future__ import annotations

import base64
import hashlib
import http.client

import huggingface_hub
import pytest
from test_hub import (  # hub_listing: autouse, no test reaches the network
    COMMIT,
    REPO,
    _failing_download,
    _online_hub,
    hub_listing,  # noqa: F401
    populate_hub_cache,
)
from test_tokenizer import Tekkenizer, _byte_tekken, _data_error, _write_json

import voxtral_mlx.hub as hub_module
from voxtral_mlx import tokenizer as tokenizer_mod
from voxtral_mlx.errors import InputError, ModelNotFoundError
from voxtral_mlx.hub import (
    DEFAULT_REPO,
    MISTRAL_PATTERNS,
    MLX_PATTERNS,
    allow_patterns,
    layout_patterns,
    looks_like_repo_id,
    resolve_model_dir,
)
from voxtral_mlx.synthetic.tekken import build_tekken, write_tekken
from voxtral_mlx.tokenizer import TekkenTokenizer, default_cache_dir, speech_prompt_ids


def _with_token(data: dict, token: bytes) -> dict:
    """``data`` with ``token`` appended to its vocabulary as the next rank."""
    rank = len(data["vocab"])
    b64 = base64.b64encode(token).decode()
    data["vocab"].append({"rank": rank, "token_bytes": b64, "token_str": None})
    data["config"]["default_vocab_size"] += 1
    return data


def _load(data: dict, tmp_path) -> TekkenTokenizer:
    path = _write_json(tmp_path / "tekken.json", data)
    return TekkenTokenizer.from_file(path, cache_dir=tmp_path / "cache")


# ---------------------------------------------------------------------- special tokens


def test_more_special_tokens_than_configured_are_refused(tmp_path):
    data = _byte_tekken()
    data["special_tokens"].append({"rank": 1000, "token_str": "<extra>"})
    message = _data_error(data, tmp_path)
    assert "1001 special tokens but config.default_num_special_tokens is 1000" in message


def test_a_special_token_without_a_rank_is_refused(tmp_path):
    data = _byte_tekken()
    del data["special_tokens"][3]["rank"]
    message = _data_error(data, tmp_path)
    assert "special_tokens[3] ([INST]) has rank None, expected 3" in message


def test_special_token_count_limit_is_inclusive_of_100000(tmp_path):
    data = _byte_tekken(config__default_num_special_tokens=100_001)
    data["config"]["default_vocab_size"] = 100_001 + 256
    message = _data_error(data, tmp_path)
    assert "default_num_special_tokens is 100001" in message
    assert "at most 100000 are accepted" in message


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        pytest.param(
            {"config__default_num_special_tokens": 0},
            "config.default_num_special_tokens must be a positive integer, got 0",
            id="zero-special-tokens",
        ),
        pytest.param(
            {"config__version": 7}, "config.version must be a string, got 7", id="version-no-string"
        ),
        pytest.param(
            {"config__default_vocab_size": 1255},
            "default_vocab_size 1255 leaves 255 text tokens after 1000 special tokens",
            id="255-text-tokens",
        ),
        pytest.param(
            {"config__default_vocab_size": 1257},
            "vocab has 256 entries but default_vocab_size - default_num_special_tokens = 257",
            id="vocab-one-entry-short",
        ),
    ],
)
def test_a_config_value_out_of_its_rule_is_refused(tmp_path, config, expected):
    assert expected in _data_error(_byte_tekken(**config), tmp_path)


def test_a_voice_of_zero_audio_tokens_is_accepted(tmp_path):
    tok = _load(build_tekken({"silent": 0}, vocab_source=None), tmp_path)
    assert tok.voice_num_audio_tokens == {"silent": 0}


def test_voice_row_count_limit_is_inclusive_of_4096(tmp_path):
    tok = _load(build_tekken({"long": 4096}, vocab_source=None), tmp_path / "ok")
    assert tok.voice_num_audio_tokens == {"long": 4096}
    data = build_tekken({"long": 4097}, vocab_source=None)
    message = _data_error(data, tmp_path)
    assert "gives voice long 4,097 rows (at most 4,096 are accepted" in message


# ---------------------------------------------------------------------- vocabulary


def test_the_last_byte_token_must_be_byte_255(tmp_path):
    data = _byte_tekken()
    data["vocab"][255]["token_bytes"] = base64.b64encode(b"\xfe").decode()
    message = _data_error(data, tmp_path)
    assert "vocab[255] must be the single byte 255, got b'\\xfe'" in message


def test_token_length_limit_is_1024_bytes(tmp_path):
    tok = _load(_with_token(_byte_tekken(), b"x" * 1024), tmp_path / "ok")
    assert tok.max_token_bytes == 1024
    data = _with_token(_byte_tekken(), b"x" * 1025)
    message = _data_error(data, tmp_path)
    assert "vocab[256] is 1025 bytes long (at most 1024 are accepted" in message


def test_merge_limit_is_the_most_merges_accepted(tmp_path, monkeypatch):
    data = _with_token(_byte_tekken(), b"ab")  # makes the one merge ("a", "b")
    monkeypatch.setattr(tokenizer_mod, "MAX_MERGES", 1)
    assert _load(data, tmp_path / "ok").encode("ab") == [1256]
    monkeypatch.setattr(tokenizer_mod, "MAX_MERGES", 0)
    message = _data_error(data, tmp_path)
    assert "its vocabulary makes over 0 merges" in message


def test_a_piece_that_is_a_token_is_that_token_even_out_of_merge_reach(tmp_path):
    """tiktoken emits a piece found in the vocabulary as is: merging by rank would stop at
    a, bc, d (neither "abc" nor "bcd" is a token)."""
    data = _with_token(_with_token(_byte_tekken(), b"bc"), b"abcd")
    tok = _load(data, tmp_path)
    ref = Tekkenizer.from_file(tmp_path / "tekken.json")
    assert tok.encode("abcd") == ref.encode("abcd", bos=False, eos=False) == [1257]


# ---------------------------------------------------------------------- text


def test_min_tokens_divides_by_the_longest_token_rounding_up(tmp_path):
    data = _with_token(_with_token(_byte_tekken(), b"ab"), b"abc")
    built = _load(data, tmp_path)
    cached = _load(data, tmp_path)  # the same file: read from the cache entry
    for tok in (built, cached):
        assert tok.max_token_bytes == 3
        assert [tok.min_tokens("x" * n) for n in (0, 1, 3, 7)] == [0, 1, 1, 3]


def test_bytes_are_no_token_ids(tmp_path):
    tok = _load(_byte_tekken(), tmp_path)
    with pytest.raises(InputError) as info:
        tok.decode(b"ab")
    assert str(info.value) == "ids must be a sequence of integers, got bytes"


def test_a_bool_is_no_voice_token_count(tmp_path):
    tok = _load(_byte_tekken(), tmp_path)
    with pytest.raises(InputError) as info:
        speech_prompt_ids(tok, "Hi.", True)
    assert str(info.value) == "num_voice_tokens must be an int, got bool"


# ---------------------------------------------------------------------- cache


def test_xdg_cache_home_with_a_tilde_is_expanded(monkeypatch, tmp_path):
    monkeypatch.delenv("VOXTRAL_MLX_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")
    assert default_cache_dir() == tmp_path / "xdg" / "voxtral_mlx"


def test_an_entry_under_another_files_name_is_not_used(tmp_path):
    """The entry's name is only where it is looked up: its recorded digest decides."""
    cache = tmp_path / "cache"
    first = _write_json(tmp_path / "a" / "tekken.json", _byte_tekken())
    second = _write_json(tmp_path / "b" / "tekken.json", _with_token(_byte_tekken(), b"ab"))
    TekkenTokenizer.from_file(first, cache_dir=cache)
    (entry,) = (cache / "tokenizers").iterdir()
    digest = hashlib.sha256(second.read_bytes()).hexdigest()
    entry.rename(entry.with_name(f"tekken-{digest}-f{tokenizer_mod.CACHE_FORMAT}.json"))
    assert TekkenTokenizer.from_file(second, cache_dir=cache).encode("ab") == [1256]


def test_eight_entries_of_other_files_are_kept(tmp_path):
    cache = tmp_path / "cache"
    names = []
    for i in range(9):
        path = write_tekken(
            tmp_path / f"m{i}" / "tekken.json", build_tekken({f"v{i}": 1}, vocab_source=None)
        )
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        names.append(f"tekken-{digest}-f{tokenizer_mod.CACHE_FORMAT}.json")
        TekkenTokenizer.from_file(path, cache_dir=cache)
    kept = sorted(p.name for p in (cache / "tokenizers").iterdir())
    assert len(kept) == 8 and names[-1] in kept


# ---------------------------------------------------------------------- hub: layouts


def test_only_visible_top_level_weights_are_added_to_a_conversion():
    files = [
        "config.json",
        "tekken.json",
        "weights.safetensors",
        ".cache.safetensors",
        "original/consolidated.safetensors",
        "voice_embedding/a.pt",
    ]
    assert layout_patterns(files) == [*MLX_PATTERNS, "weights.safetensors"]


def test_a_voice_in_a_subfolder_of_voice_embedding_is_no_voice():
    files = [
        "params.json",
        "tekken.json",
        "consolidated.safetensors",
        "voice_embedding/a.pt",
        "voice_embedding/old/a.safetensors",
    ]
    assert layout_patterns(files) == MISTRAL_PATTERNS


def test_owner_and_name_say_mlx_in_any_case():
    assert allow_patterns("someone/Voxtral-TTS-MLX-4bit") == MLX_PATTERNS
    assert allow_patterns("MLX-Community/Voxtral-4B-TTS-2603") == MLX_PATTERNS


def test_a_mistral_folder_without_params_json_is_no_whole_model(tmp_path):
    (tmp_path / "tekken.json").write_text("{}")
    (tmp_path / "consolidated.safetensors").write_bytes(b"")
    assert not hub_module._holds_a_model(tmp_path)
    (tmp_path / "params.json").write_text("{}")
    assert hub_module._holds_a_model(tmp_path)


# ---------------------------------------------------------------------- hub: names


def test_an_owner_with_two_dots_is_no_repo_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not looks_like_repo_id("a..b/model")


def test_a_local_folder_named_like_a_known_owner_in_other_case_does_not_hide_it(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "MistralAI").mkdir()
    assert looks_like_repo_id("MistralAI/Voxtral-4B-TTS-2603")


def test_a_broken_link_named_like_the_owner_makes_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").symlink_to(tmp_path / "gone")
    assert not looks_like_repo_id("models/tiny")


def test_a_blank_model_name_is_an_empty_name():
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir("   ")
    assert str(info.value).startswith("the model is an empty name; pass a directory")


def test_cached_repo_needs_a_snapshot_folder(tmp_path):
    repo = tmp_path / "models--acme--tiny"
    assert hub_module.cached_repo(repo / "snapshots" / COMMIT) == "acme/tiny"
    assert hub_module.cached_repo(repo / "blobs" / "0123abcd") is None


# ---------------------------------------------------------------------- hub: errors


def test_a_gone_repo_says_to_check_its_id(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _failing_download(410, False))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir(DEFAULT_REPO)
    assert f"answered HTTP 410 for {DEFAULT_REPO}: check the repo id and run again later" in str(
        info.value
    )


def test_a_refused_login_is_named_though_an_older_copy_is_cached(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """A 401 while fetching an update is the user's to fix: the older cached copy does not
    hide it (as a dropped connection's would be)."""
    cache = tmp_path / "hf" / "hub"
    _online_hub(monkeypatch, cache, tiny_checkpoint, sha="f" * 40)
    populate_hub_cache(cache, REPO, tiny_checkpoint)  # whole, at COMMIT
    from_cache = huggingface_hub.snapshot_download
    refused = _failing_download(401, False)

    def download(*args, **kwargs):
        return (from_cache if kwargs.get("local_files_only") else refused)(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir(REPO)
    assert str(info.value).startswith(f"the Hugging Face Hub refused your login for {REPO} (401")


def test_a_listing_cut_off_is_not_called_a_download_cut_off(tiny_checkpoint, tmp_path, monkeypatch):
    """Nothing was fetched: "run again to finish it (the files already fetched are kept)"
    would be wrong."""
    _online_hub(monkeypatch, tmp_path / "hf" / "hub", tiny_checkpoint)

    def cut_off(repo_id, **kwargs):
        raise http.client.IncompleteRead(b"{")

    monkeypatch.setattr(huggingface_hub, "model_info", cut_off)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir(REPO)
    assert str(info.value).startswith(f"could not download {REPO} (IncompleteRead: ")


# ---------------------------------------------------------------------- hub: refs/main


def test_fetching_the_voices_alone_into_an_empty_cache_names_them_in_refs_main(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """Offline, huggingface_hub (and other tools) find a snapshot through refs/main only."""
    cache = tmp_path / "hf" / "hub"
    _online_hub(monkeypatch, cache, tiny_checkpoint)
    snapshot = resolve_model_dir(REPO, weights=False)
    assert snapshot == cache / "models--owner-x--voxtral-tiny" / "snapshots" / COMMIT
    assert (cache / "models--owner-x--voxtral-tiny" / "refs" / "main").read_text() == COMMIT


def test_moving_refs_main_to_a_cached_commit_is_no_download(tiny_checkpoint, tmp_path, monkeypatch):
    cache = tmp_path / "hf" / "hub"
    _online_hub(monkeypatch, cache, tiny_checkpoint)
    populate_hub_cache(cache, REPO, tiny_checkpoint)  # every file at COMMIT, the one listed
    refs_main = cache / "models--owner-x--voxtral-tiny" / "refs" / "main"
    refs_main.write_text("e" * 40)  # but refs/main names another commit
    started = []
    monkeypatch.setattr(hub_module, "download_started", lambda *args: started.append(args))
    resolve_model_dir(REPO)
    assert started == [] and refs_main.read_text() == COMMIT

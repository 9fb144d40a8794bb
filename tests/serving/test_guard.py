"""The ingress guard's parts without Ray: key sources, constant-time matching, stream admission."""

from __future__ import annotations

import pytest

from serve_app.config import ApiConfig
from serve_app.errors import ApiError
from serve_app.front.guard import KeyRing, StreamAdmission


def test_keys_come_from_config_env_and_file_and_are_labelled_by_position(
        tmp_path, monkeypatch) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\nfile-1\nfile-2, file-3  # trailing comment\n\n")
    monkeypatch.setenv("MY_KEYS", "env-1,env-2")
    ring = KeyRing.from_config(ApiConfig(api_key="cfg-0", api_keys_env="MY_KEYS",
                                         api_keys_file=str(keys_file)))
    assert len(ring) == 6
    assert ring.authenticate("Bearer cfg-0") == "key#0"
    assert ring.authenticate("bearer  env-2") == "key#2"
    assert ring.authenticate("Bearer file-3") == "key#5"
    for header in ("", "Bearer", "Bearer file-", "Bearer file-33", "Basic file-1", "file-1"):
        with pytest.raises(ApiError) as error:
            ring.authenticate(header)
        assert error.value.status_code == 401
        assert "file-" not in error.value.message


def test_no_keys_means_no_auth_but_an_empty_configured_source_refuses_to_start(
        monkeypatch) -> None:
    assert KeyRing.from_config(ApiConfig()).authenticate("") is None
    monkeypatch.setenv("EMPTY_KEYS", " , ")
    with pytest.raises(ValueError):
        KeyRing.from_config(ApiConfig(api_keys_env="EMPTY_KEYS"))


def test_admission_limits_streams_per_key_429_and_in_total_503() -> None:
    admission = StreamAdmission(max_streams=3, max_streams_per_key=2)
    admission.acquire("key#0")
    admission.acquire("key#0")
    with pytest.raises(ApiError) as per_key:
        admission.acquire("key#0")
    assert per_key.value.status_code == 429 and per_key.value.headers["Retry-After"]
    admission.acquire("key#1")
    with pytest.raises(ApiError) as total:
        admission.acquire("key#2")
    assert total.value.status_code == 503 and total.value.headers["Retry-After"]
    admission.release("key#0")
    admission.acquire("key#2")
    assert admission.active == 3 and admission.per_key == {"key#0": 1, "key#1": 1, "key#2": 1}

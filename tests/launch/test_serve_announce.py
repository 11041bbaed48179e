"""`<run dir>/serve.json` tells scripts where the service listens; they poll for it and read it as
soon as it exists, so no moment of its writing may show them an empty or partial file."""

import io
import json
import os

from podtrain.launch.serve import announce


def test_serve_json_is_replaced_whole_and_never_truncated_in_place(tmp_path, monkeypatch):
    target = tmp_path / "serve.json"
    target.write_text(json.dumps({"url": "http://127.0.0.1:1", "pid": 1}) + "\n")
    seen = []  # what a reader finds each time a file has just been opened for writing
    real_open = io.open

    def watching_open(file, mode="r", *args, **kwargs):
        opened = real_open(file, mode, *args, **kwargs)
        if set(mode) & set("wax+"):
            seen.append(target.read_text())
        return opened

    monkeypatch.setattr(io, "open", watching_open)
    announce(tmp_path, "http://127.0.0.1:2")
    monkeypatch.undo()

    assert seen, "announce wrote no file"
    assert [json.loads(text)["url"] for text in seen] == ["http://127.0.0.1:1"] * len(seen)
    assert json.loads(target.read_text()) == {"url": "http://127.0.0.1:2", "pid": os.getpid()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve.json"]

"""Images brickyard writes into a folder that holds its own earlier output are replaced or refused, never
silently kept: ``data export --jpeg 64`` after ``--jpeg 16`` said 64x64 and left every file 16x16."""
import pytest
from PIL import Image

from brickyard.data.export import RECORD, prepare_folder
from brickyard.errors import BrickyardError
from conftest import needs_mnist, run_cli


def _sizes(folder):
    return {Image.open(f).size for f in folder.rglob("*.jpg")}


@needs_mnist
def test_a_second_export_with_another_size_or_format_replaces_the_first(tmp_path):
    out = tmp_path / "out"
    assert run_cli("data", "export", "mnist", str(out), "--limit", "2", "--jpeg", "16").returncode == 0
    assert _sizes(out) == {(16, 16)}
    r = run_cli("data", "export", "mnist", str(out), "--limit", "2", "--jpeg", "64")
    assert r.returncode == 0 and "64x64 RGB JPEG" in r.stdout, r.stderr
    assert _sizes(out) == {(64, 64)} and len(list(out.rglob("*.jpg"))) == 60
    r = run_cli("data", "export", "mnist", str(out), "--limit", "1")  # PNGs now: no JPEG of before stays beside them
    assert r.returncode == 0, r.stderr
    assert not list(out.rglob("*.jpg")) and len(list(out.rglob("*.png"))) == 30


def test_make_photos_with_other_settings_replaces_the_earlier_photos(tmp_path):
    out = tmp_path / "photos"
    common = ["--classes", "2", "--per-class", "1", "1", "1", "--min-size", "32"]
    assert run_cli("data", "make-photos", str(out), *common, "--max-size", "32").returncode == 0
    assert max(max(s) for s in _sizes(out)) == 32
    r = run_cli("data", "make-photos", str(out), *common, "--min-size", "80", "--max-size", "80")
    assert r.returncode == 0, r.stderr
    assert _sizes(out) == {(80, 80)}


@pytest.mark.fast
def test_the_folder_record_keeps_an_interrupted_runs_files_replaces_others_and_refuses_unclaimed_ones(tmp_path):
    image = tmp_path / "train" / "0" / "00001.png"
    image.parent.mkdir(parents=True)
    image.write_bytes(b"not ours")
    mine = tmp_path / "train" / "0" / "notes.txt"
    mine.write_text("a user's")
    with pytest.raises(BrickyardError, match=r"already holds images named as brickyard writes them .*00001.png"):
        prepare_folder(tmp_path, {"command": "data export", "jpeg": 16})
    image.unlink()
    prepare_folder(tmp_path, {"command": "data export", "jpeg": 16})
    assert (tmp_path / RECORD).is_file()
    image.write_bytes(b"written by that export")
    prepare_folder(tmp_path, {"command": "data export", "jpeg": 16})  # the same settings: completes it
    assert image.read_bytes() == b"written by that export"
    prepare_folder(tmp_path, {"command": "data export", "jpeg": 64})  # others: its files go first
    assert not image.exists() and mine.read_text() == "a user's"

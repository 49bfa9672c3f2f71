"""The folder generated kernel modules are written to and imported from (`opfuse.codegen.base.kernel_source_dir`):
private to this user, and a module in it imported only holding the source its name says (issue 53, attack 3)."""

import os
import sys
from pathlib import Path

import pytest


def test_the_kernel_folder_is_created_private(tmp_path, monkeypatch):
    from opfuse.codegen.base import kernel_source_dir

    monkeypatch.setenv("OPFUSE_KERNEL_DIR", str(tmp_path / "kernels"))
    folder = kernel_source_dir()
    assert folder == tmp_path / "kernels" and (folder.stat().st_mode & 0o777) == 0o700


def test_a_kernel_folder_open_to_others_is_tightened_and_one_of_another_user_refused(tmp_path):
    from opfuse.files import UnsafeFolder, private_dir

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    assert private_dir(shared).stat().st_mode & 0o777 == 0o700
    link = tmp_path / "link"
    link.symlink_to(shared)
    with pytest.raises(UnsafeFolder, match="symbolic link"):
        private_dir(link)
    if os.getuid() != 0:
        pytest.skip("only root can give a folder to another user")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 12345, 12345)
    with pytest.raises(UnsafeFolder, match="belongs to user 12345"):
        private_dir(theirs)


def test_a_cached_kernel_module_is_imported_only_holding_the_source_its_name_says(tmp_path, monkeypatch):
    """Issue 53, attack 3: code appended to a generated module in the kernel folder ran at the next load."""
    from opfuse.codegen.base import import_kernel, load_source

    monkeypatch.setenv("OPFUSE_KERNEL_DIR", str(tmp_path / "kernels"))
    marker = tmp_path / "pwned"
    source = "VALUE = 1\n"
    module = load_source(source, "attack3")
    path = Path(module.__file__)
    with open(path, "a") as f:
        f.write(f"open({str(marker)!r}, 'w').close()\n")
    del sys.modules[module.__name__]               # as a new process would: nothing imported yet
    again = load_source(source, "attack3")
    assert again.VALUE == 1 and not marker.exists()
    assert path.read_text() == source              # written again as the name says
    with open(path, "a") as f:
        f.write(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(ValueError, match="does not hold the source its name says"):
        import_kernel(path)
    assert not marker.exists()

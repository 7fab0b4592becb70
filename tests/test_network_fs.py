"""An ``nvme.path`` on a network or FUSE filesystem is refused at open (LMDB's locks and shared map
are unsafe there) with a ConfigError naming ``nvme.path``, the filesystem type and the opt-out
``nvme.allow_network_fs`` (issue 16, item 3).

The detector (:func:`ectier.tiers.storedir.mount_of`) is a pure function of mountinfo text; the
integration tests mount a real FUSE filesystem (``tests/fuse_mount.py``; root and /dev/fuse
needed, skipped with the reason otherwise).
"""

from __future__ import annotations

import os

import pytest

from ectier import CacheConfig, ConfigError, StoreOpenError, TieredCache
from ectier.config import NvmeTierConfig
from ectier.tiers.storedir import check_local_filesystem, is_network_fs, mount_of, parse_mountinfo

from conftest import make_config
from fuse_mount import fuse_mount

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
30 27 0:40 / /mnt/nfs rw,relatime shared:12 - nfs4 filer:/export rw,vers=4.2
31 27 0:41 / /mnt/nfs2 rw,relatime - xfs /dev/nvme0n1 rw
32 30 0:42 / /mnt/nfs/local rw,relatime - ext4 /dev/nvme1n1 rw
33 27 0:43 / /mnt/my\\040disk rw,relatime master:3 propagate_from:2 - cifs //srv/share rw
34 27 0:44 / /data rw,relatime - ext4 /dev/sdb rw
35 27 0:45 / /data rw,relatime - fuse.sshfs me@host:/data rw,user_id=0
36 27 0:46 / /scratch rw - 9p hostshare rw,trans=virtio
broken line without separator
"""


def test_mount_of_takes_the_longest_mount_point_on_a_path_boundary():
    assert mount_of("/var/lib/ectier", MOUNTINFO).fstype == "ext4"
    assert mount_of("/mnt/nfs/ectier", MOUNTINFO).fstype == "nfs4"
    assert mount_of("/mnt/nfs", MOUNTINFO).mount_point == "/mnt/nfs"
    assert mount_of("/mnt/nfs2/ectier", MOUNTINFO).fstype == "xfs"  # not a prefix match on "/mnt/nfs"
    assert mount_of("/mnt/nfs/local/ectier", MOUNTINFO).fstype == "ext4"  # a local disk mounted inside NFS
    m = mount_of("/mnt/my disk/store", MOUNTINFO)  # octal escapes in mount points
    assert (m.mount_point, m.fstype, m.source) == ("/mnt/my disk", "cifs", "//srv/share")
    assert mount_of("/data/x", MOUNTINFO).fstype == "fuse.sshfs"  # mounted over: the last one wins
    assert mount_of("/scratch/s", MOUNTINFO).fstype == "9p"
    assert len(parse_mountinfo(MOUNTINFO)) == 9
    assert mount_of("/x", "") is None


def test_mount_of_resolves_symlinks_and_relative_paths(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    info = f"1 0 0:1 / / rw - ext4 /dev/root rw\n2 1 0:2 / {real} rw - nfs srv:/x rw\n"
    assert mount_of(tmp_path / "link" / "store", info).fstype == "nfs"
    monkeypatch.chdir(tmp_path)
    assert mount_of("link/store", info).fstype == "nfs"
    assert mount_of("other", info).fstype == "ext4"


@pytest.mark.parametrize("fstype", ["nfs", "nfs4", "cifs", "smb3", "9p", "ceph", "glusterfs", "lustre",
                                    "gpfs", "fuse", "fuse.sshfs", "fuse.s3fs", "virtiofs"])
def test_network_filesystems_are_refused_naming_the_knob(fstype):
    info = f"1 0 0:1 / / rw - ext4 /dev/root rw\n2 1 0:2 / /remote rw - {fstype} srv:/export rw\n"
    assert is_network_fs(fstype)
    with pytest.raises(ConfigError) as exc:
        check_local_filesystem("/remote/ectier", allow=False, mountinfo=info)
    text = str(exc.value)
    assert "nvme.path" in text and fstype in text and "/remote" in text and "nvme.allow_network_fs" in text
    assert check_local_filesystem("/remote/ectier", allow=True, mountinfo=info).fstype == fstype


@pytest.mark.parametrize("fstype", ["ext4", "xfs", "btrfs", "zfs", "tmpfs", "overlay", "f2fs"])
def test_local_filesystems_are_accepted(fstype):
    info = f"1 0 0:1 / / rw - {fstype} /dev/root rw\n"
    assert not is_network_fs(fstype)
    assert check_local_filesystem("/var/ectier", allow=False, mountinfo=info).fstype == fstype


def test_this_machines_test_directory_is_accepted(tmp_path):
    """The real /proc/self/mountinfo: the tests' own stores are on a local filesystem."""
    m = mount_of(tmp_path)
    assert m is not None and not is_network_fs(m.fstype), m


def test_allow_network_fs_is_a_checked_config_field():
    assert NvmeTierConfig().allow_network_fs is False
    with pytest.raises(ConfigError, match="nvme.allow_network_fs"):
        NvmeTierConfig(allow_network_fs="yes")
    cfg = CacheConfig.from_env({"ECTIER_NVME__ALLOW_NETWORK_FS": "true", "ECTIER_NVME__PATH": "/x"})
    assert cfg.nvme.allow_network_fs is True


@pytest.fixture
def fuse_dir(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        with fuse_mount(str(mnt)):
            yield mnt
    except OSError as exc:
        pytest.skip(f"cannot mount a FUSE filesystem here (root and /dev/fuse needed): {exc}")


def test_a_store_on_a_real_fuse_mount_is_refused_at_open(fuse_dir):
    with pytest.raises(ConfigError) as exc:
        TieredCache(make_config(fuse_dir / "store", host_bytes=0))
    text = str(exc.value)
    assert "nvme.path" in text and "fuse.ectiertest" in text and "nvme.allow_network_fs" in text, text
    assert str(fuse_dir) in text
    # with the opt-out the check is skipped and the tier goes on to create the directory, which
    # this read-only test filesystem refuses (a real one would be used)
    with pytest.raises(StoreOpenError, match="cannot create") as exc:
        TieredCache(make_config(fuse_dir / "store", host_bytes=0, allow_network_fs=True))
    assert not isinstance(exc.value, ConfigError)


def test_a_symlink_into_a_fuse_mount_is_refused(fuse_dir, tmp_path):
    link = tmp_path / "looks-local"
    os.symlink(fuse_dir, link)
    with pytest.raises(ConfigError, match="fuse.ectiertest"):
        TieredCache(make_config(link / "store", host_bytes=0))

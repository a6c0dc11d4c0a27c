# ruff: noqa: E501  (the tools print lines this wide)
"""The quota tools' text, parsed: samples in the forms the tools print (Lustre's lfs, GPFS's
mmlsquota, Linux's quota), as sites' documentation and users' reports show them; values made up."""

from __future__ import annotations

from rv.job.footprint import (
    Quota,
    parse_lfs_quota,
    parse_mmlsquota,
    parse_quota,
    quota_warning,
    read_quota_report,
)

LFS = """\
Disk quotas for usr jdoe (uid 12345):
     Filesystem  kbytes   quota   limit   grace   files   quota   limit   grace
       /scratch 52428800       0 1073741824       -  812345       0 1000000       -
uid 12345 is using default file quota setting
"""

# A long mount point on a line of its own; values Lustre is unsure of in brackets; over a limit: *.
LFS_WRAPPED = """\
Disk quotas for usr jdoe (uid 12345):
     Filesystem  kbytes   quota   limit   grace   files   quota   limit   grace
/lustre/very/long/mount/point
                [1041408]  5242880 6291456       -  950001*  900000  1000000  6d23h59m
"""

LFS_HUMAN = """\
Disk quotas for usr jdoe (uid 12345):
     Filesystem    used   quota   limit   grace   files   quota   limit   grace
             ./  792.3M      0k  9.537T       -       9       0 2000000       -
"""

LFS_NO_LIMITS = """\
Disk quotas for usr jdoe (uid 12345):
     Filesystem  kbytes   quota   limit   grace   files   quota   limit   grace
       /scratch       4       0       0       -       1       0       0       -
"""

MMLSQUOTA = """\
                         Block Limits                                    |     File Limits
Filesystem type             KB      quota      limit   in_doubt    grace |    files   quota    limit in_doubt    grace  Remarks
gpfs       USR        28292096 3221225472 4294967296          0     none |   136704 2000000  3000000        0     none
scratch    USR          102400          0          0          0     none |      12       0        0        0     none
"""

MMLSQUOTA_AUTO = """\
                         Block Limits                                    |     File Limits
Filesystem type         blocks      quota      limit   in_doubt    grace |    files   quota    limit in_doubt    grace  Remarks
scratch    USR          201.6G         1T         2T     561.5M     none |   586773       0        0      239     none DSSP.x
"""

MMLSQUOTA_NO_LIMITS = """\
                         Block Limits                                    |     File Limits
Filesystem type             KB      quota      limit   in_doubt    grace |    files   quota    limit in_doubt    grace  Remarks
gpfs       FILESET     no limits
"""

# quota -w: no grace column printed unless over a limit; -s: units (files in thousands).
QUOTA = """\
Disk quotas for user jdoe (uid 1000):
     Filesystem  blocks   quota   limit   grace   files   quota   limit   grace
      /dev/sda1   12345  100000  110000            1234   50000   55000
nfs.example.org:/export/home
                 99000*  90000  100000   6days   49000   50000   55000
"""

QUOTA_HUMAN = """\
Disk quotas for user jdoe (uid 1000):
     Filesystem   space   quota   limit   grace   files   quota   limit   grace
    /nfs_global    479G   5120G   7168G            352k   5000k  10000k
"""


def test_lfs_quota_in_kbytes():
    assert parse_lfs_quota(LFS) == [
        Quota("lfs", "/scratch", 52428800 * 1024, 1073741824 * 1024, 812345, 1000000)
    ]


def test_lfs_quota_wrapped_name_brackets_and_a_user_over_the_soft_limit():
    (q,) = parse_lfs_quota(LFS_WRAPPED)
    assert q == Quota("lfs", "/lustre/very/long/mount/point", 1041408 * 1024, 5242880 * 1024, 950001, 900000)
    assert q.files_share is not None and q.files_share > 1


def test_lfs_quota_human_units_and_no_limits():
    (q,) = parse_lfs_quota(LFS_HUMAN)
    assert q.bytes_used == int(792.3 * 2**20) and q.bytes_limit == int(9.537 * 2**40)
    assert (q.files_used, q.files_limit) == (9, 2000000)
    (none,) = parse_lfs_quota(LFS_NO_LIMITS)
    assert none.files_limit is None and none.bytes_limit is None and none.files_share is None


def test_mmlsquota_in_kb_and_auto_units():
    assert parse_mmlsquota(MMLSQUOTA) == [
        Quota("mmlsquota", "gpfs", 28292096 * 1024, 3221225472 * 1024, 136704, 2000000),
        Quota("mmlsquota", "scratch", 102400 * 1024, None, 12, None),
    ]
    (q,) = parse_mmlsquota(MMLSQUOTA_AUTO)
    assert q.bytes_used == int(201.6 * 2**30) and q.bytes_limit == 2**40 and q.files_limit is None
    assert parse_mmlsquota(MMLSQUOTA_NO_LIMITS) == []


def test_quota_with_and_without_the_grace_column_and_a_wrapped_nfs_name():
    assert parse_quota(QUOTA) == [
        Quota("quota", "/dev/sda1", 12345 * 1024, 100000 * 1024, 1234, 50000),
        Quota("quota", "nfs.example.org:/export/home", 99000 * 1024, 90000 * 1024, 49000, 50000),
    ]
    (q,) = parse_quota(QUOTA_HUMAN)
    assert q.bytes_used == 479 * 2**30 and (q.files_used, q.files_limit) == (352_000, 5_000_000)


def test_empty_and_odd_output_gives_no_rows():
    for parse in (parse_lfs_quota, parse_mmlsquota, parse_quota):
        assert parse("") == []
        assert parse("quota: error while getting quota from /dev/sda1 for 1000: No such process\n") == []


def test_the_report_keeps_the_rows_of_the_roots_filesystem_and_says_what_failed():
    reply = {
        "mount": "/scratch", "source": "10.0.0.1@o2ib:/scratch", "fstype": "lustre",
        "tools": [{"tool": "lfs", "code": 0, "text": LFS}],
    }  # fmt: skip
    report = read_quota_report(reply)
    assert report.root == report.quotas and report.tools == ("lfs",)
    nfs = read_quota_report(
        {"mount": "/home", "source": "/dev/sda1", "tools": [{"tool": "quota", "code": 0, "text": QUOTA}]}
    )
    assert [q.filesystem for q in nfs.root] == ["/dev/sda1"] and len(nfs.quotas) == 2
    failed = read_quota_report({"tools": [{"tool": "quota", "error": "no answer in 5 s"}]})
    assert failed.errors == ("quota: no answer in 5 s",) and failed.quotas == ()
    assert read_quota_report(None) == read_quota_report({"tools": []})


def test_rv_run_warns_before_passing_90_percent_of_a_file_quota():
    (q,) = parse_lfs_quota(LFS)  # 812,345 of 1,000,000
    assert quota_warning([q], 50_000) is None  # 86%
    said = quota_warning([q], 100_000)  # 91%
    assert said is not None and "812,345 of 1,000,000 files used (81%), 91% with this run's 100,000" in said
    assert "--work-dir node" in said
    assert quota_warning(parse_lfs_quota(LFS_NO_LIMITS), 10**9) is None

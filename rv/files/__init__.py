"""A snapshot's files on the laptop: which files, where they came from, the snapshot and its upload,
`rv sync`, and rv's temporary folders.

    gitcmd.py      git, the one local seam: every git command rv runs on this machine
    gitrepo.py     what git says about a repository: where it is, its config, attributes, index
    listing.py     which files a snapshot holds and their blob ids: git's answer, listed fast
    tree.py        a listed tree: its entries, its manifest, what git said of its repository
    treecache.py   what this machine remembers between listings and uploads (a resubmit costs what changed)
    repo.py        the repository's facts recorded with each run: top folder, HEAD, branch, remote
    provenance.py  where a snapshot came from, and the diff of a dirty tree
    snapshot.py    a snapshot: prepared locally (listing, size guard, provenance), then shipped
    packs.py       the laptop's half of the git store: a snapshot as a commit, the packs that carry it
    link.py        the link's rate measured by uploads, and how the packs are made for it
    sync.py        `rv sync push` and `watch`: plans are pure, applying one is one round trip
    pull.py        `rv sync pull`: a remote file or folder into a local one
    progress.py    progress of a transfer, reported by the core to a renderer
    tmpdirs.py     rv's temporary folders, and the ones a killed rv left behind
"""

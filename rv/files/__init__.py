"""A snapshot's files on the laptop: which files (listing, treecache), where they came from
(provenance), the snapshot and its upload (snapshot), `rv sync` (sync), and rv's temporary folders,
those a killed rv left swept away (tmpdirs)."""

"""A snapshot's files on the laptop: which files (listing, treecache), where they came from
(provenance), the snapshot and its upload (snapshot), and `rv sync` (sync)."""

"""`rv ui`: a local web page of every run, chain and sweep of every profile, with metric plots and
live logs.

data.py     what the page shows, asked of each cluster through rv's own core (rv.job.query, the
            agent's ``runs``, ``follow``, ``ckpt-ls`` modes, rv.job.cleanup.stop_runs, rv.job.retry)
            over rv's connections (rv.remote.connect: the warm one where there is one)
server.py   a WSGI app (Werkzeug) that serves the page and its JSON, to the holder of the token only
static/     the page: plain HTML, CSS and JavaScript, and uPlot (vendored, built; see VENDORED.md)
"""

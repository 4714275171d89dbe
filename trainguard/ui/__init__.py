"""``trainguard ui``: a live page per run, served on loopback by default.

One reader follows the project's topics from their beginning (no consumer group: it disturbs
nothing): statuses (breaker, open alerts, silences), alerts, commands, acks, diagnosis
reports, and the metric events of each run, of which it keeps only what a rule watches, over
the whole run in at most ``max_points`` points per series (:class:`Series`). Pages are built
on request from that memory:

- ``/``: the runs a worker reports on, newest first, as ``trainguard runs`` lists them (the
  status topic) and in its words for their state ("finished", "awaiting rollback"); a run id
  heard of only on the events topic makes no run (its records may be ones the worker refused),
  it is counted below; a run id that several trainer processes logged says how many attempts
- ``/run/<run>``: the run's state, each watched signal as a plot by step over the whole run
  (``?from=&to=`` zooms to those steps) with the rolling baseline band the rules judge
  against, alerts as markers with their id, severity and state, breaker decisions as vertical
  lines, each new trainer process (an attempt) as a purple one; the alerts (with silences and
  acks, and their attempt), commands and acks in time order, and reports
- ``/run/<run>/report/<report id>``: the diagnosis report page (the reports sink's), every
  signal its alerts name plotted from what this page keeps, linked back to the run's page

After a rollback a series holds two branches over the same steps. The part of the old one the
run replaced stays drawn, in grey, with its markers; every alert is drawn on the branch it fired
on (its time against the time of the event that restored the step), at its value on that
branch's line; each branch's band is computed from the values it holds (the old branch's up to
the restored step, then its own), never from what the run abandoned.
- ``/api/run/<run>``: the same as JSON

Plots are SVG written on the server (:func:`trainguard.sinks.reports.svg_steps_plot`, shared
with the report page): real axes, downsampled to the pixels so a 100,000-step run stays quick,
a new segment where a rollback restored an earlier step, the value under the cursor and
click-to-zoom in CSS and links. No JavaScript and no plotting library, so the page works in
any browser and offline, can be saved as one file, and the no-script policy stays. Pages
refresh themselves every few seconds.

Whoever can write to a topic writes what these pages show, so: each record is decoded strictly
for the topic it came from (a forged alert on the events topic shows nowhere), a bad one is
skipped and counted (the count is on the pages), every value is escaped for where it is written
(text, attribute, SVG, link) and no page runs script (its Content-Security-Policy says so too).
Everything kept is bounded (:class:`Board`). Pages are rendered from a copy, outside the lock
the reader needs. The ``Host`` header must name this server (DNS rebinding), and bound beyond
loopback every request needs the token (``TRAINGUARD_UI_TOKEN``, else one made and printed).

Where each part lives: ``server.py`` (routes, :class:`UiServer`, :func:`main`), ``access.py``
(the ``Host`` and token checks, the headers), ``reader.py`` (:class:`Board`, :class:`Follower`),
``series.py`` (:class:`Series`), ``views.py`` (what a page shows of each record), ``pages.py``
(the renderers), ``plots.py`` (the SVG plots and their baseline band).
"""

from trainguard.ui.access import LOOPBACK_NAMES, TOKEN_COOKIE, Access, is_loopback
from trainguard.ui.pages import REFRESH_S, render_index, render_report_page, render_run
from trainguard.ui.plots import rolling_band
from trainguard.ui.reader import Board, Follower
from trainguard.ui.series import Series
from trainguard.ui.server import UiServer, main, make_handler, steps_range
from trainguard.ui.views import report_for_page

__all__ = ["LOOPBACK_NAMES", "REFRESH_S", "TOKEN_COOKIE", "Access", "Board", "Follower", "Series", "UiServer",
           "is_loopback", "main", "make_handler", "render_index", "render_report_page", "render_run",
           "report_for_page", "rolling_band", "steps_range"]

"""``pipepar.report``: a :class:`~pipepar.Plan` explained, as a terminal table or an HTML page.

A plan is data (:meth:`~pipepar.Plan.to_dict`, :meth:`~pipepar.Plan.to_json`); these read it.
The public names of :mod:`pipepar.render.report` and :mod:`pipepar.render.report_html`.

    >>> plan = pipepar.plan(model, sample, devices=4, capacity="16GiB", chunks=8)
    >>> print(pipepar.report.table(plan))             # per layer and per stage, and totals
    >>> pipepar.report.save_html(plan, "plan.html")   # charts; timeline=pipe.tracer adds a run
"""

from pipepar.render.report import render_report as table
from pipepar.render.report_html import render_html as html
from pipepar.render.report_html import write_html as save_html

__all__ = ["html", "save_html", "table"]

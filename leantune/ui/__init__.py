"""`leantune ui`: a local web page over the same commands a terminal user runs.

The page (static/) talks to a small FastAPI app (app.py). Everything that is not the page lives in
modules with one job, tested without a browser: the TOML a form writes (form.py), the dataset grid
and caption write-back (dataset_view.py), the plan answer (plan_answer.py), starting and stopping
`leantune train` as a separate process (launcher.py) and reading a run folder (runs.py).
FastAPI and uvicorn are imported only by app.py, so the rest of leantune never pays for them.
"""

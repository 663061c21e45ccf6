"""The page's server: a FastAPI app over the modules of this package.

Imported only by `leantune ui` (FastAPI and uvicorn are optional: `pip install leantune[ui]`).
Every /api route is a thin call into form.py, dataset_view.py, plan_answer.py, launcher.py,
runs.py or sample_job.py; bad input comes back as HTTP 400 with the module's message. Every request
passes guard.py first (Host, Origin, the session secret); datasets are confined to the data roots
chosen at start and runs to the runs folder, and every path of a run's merged config to the roots
its key may use (confine.py), and every link its datasets' scan follows to the data roots (links.py),
before the run starts or resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from ..config import ConfigError
from ..family_registry import FAMILIES
from . import confine, dataset_view, guard, labels, launcher, links, plan_answer, queue, runs, sample_job, system
from .form import FormError, RunForm, choices, families, gpu_cards, presets

STATIC = Path(__file__).parent / "static"


class TooLarge(ValueError):
    """A request body over its limit (HTTP 413)."""


@contextlib.contextmanager
def on_form(body: dict | None = None, form: str = "run", default: str | None = None):
    """Errors raised inside, in the page's words: the exception keeps its type and message (the
    terminal and the tests read those) and gains `.page`, {"error", "field"} naming the field by
    the label the page shows (labels.py), which the route's answer carries."""
    try:
        yield
    except ValueError as e:
        if getattr(e, "page", None) is None:
            extra = str((body or {}).get("extra_toml", "") or "") if form == "run" else ""
            e.page = labels.on_field(str(e), extra, form, default)
        raise


def page_error(exc: Exception) -> dict:
    """The JSON of an error: the message naming the page's field, and the field's id."""
    return getattr(exc, "page", None) or labels.on_field(str(exc))


def create_app(runs_dir: Path, token: str, data_roots: list[Path] | None = None,
               allowed_hosts: set[str] | None = None) -> FastAPI:
    """The app. `token` is the session secret every request must carry; `data_roots` the folders
    datasets may live under (default: the current folder); `allowed_hosts` the names (beyond IP
    literals and localhost) a Host header may carry."""
    if not token:
        raise ValueError("leantune ui: a session secret is required")
    runs_dir = Path(runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    roots = [Path(r).expanduser().resolve() for r in (data_roots or [Path.cwd()])]
    hosts = {h.lower() for h in (allowed_hosts or set())}
    app = FastAPI(title="leantune", docs_url=None, redoc_url=None, openapi_url=None)
    plans: dict[str, dict] = {}          # TOML text -> summary: the plan shown is the plan a run keeps
    family_names = families()            # imports the registry (and torch) now, not on the page's first call
    cfg_families = sample_job.cfg_families()     # the Sample form's negative prompt shows for these

    @app.middleware("http")
    async def check_request(request: Request, call_next):
        try:
            cookies = request.cookies
        except Exception:                  # an undecodable Cookie header: as if none were sent
            cookies = {}
        why = guard.refusal(request.method, request.headers, request.query_params, cookies, token, hosts)
        if why:
            return PlainTextResponse(why, 403)
        response = await call_next(request)
        name = guard.cookie_name(request.headers.get("host", ""))
        if cookies.get(name) != token:
            response.set_cookie(name, token, httponly=True, samesite="strict")
        return response

    @app.exception_handler(TooLarge)
    async def too_large(request: Request, exc: Exception):
        return JSONResponse(page_error(exc), status_code=413)

    @app.exception_handler(dataset_view.OutsideRoots)
    async def outside(request: Request, exc: Exception):
        return JSONResponse(page_error(exc), status_code=403)

    @app.exception_handler(ValueError)
    @app.exception_handler(OSError)
    async def user_error(request: Request, exc: Exception):
        return JSONResponse(page_error(exc), status_code=400)

    @app.get("/", response_class=HTMLResponse)
    def index():
        # the page's script sends the secret back in a header on every change (guard.py)
        return (STATIC / "index.html").read_text().replace('name="leantune-token" content=""',
                                                          f'name="leantune-token" content="{token}"')

    @app.get("/favicon.ico")
    def favicon():
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    @app.get("/static/{name}")
    def static(name: str):
        path = STATIC / Path(name).name
        if not path.is_file():
            return PlainTextResponse("not found", 404)
        return FileResponse(path)

    @app.get("/api/choices")
    def get_choices():
        return {"family": family_names, "cfg_families": cfg_families, "mode": choices("train", "mode"),
                "lora_targets": choices("lora", "targets"), "lora_type": choices("lora", "type"),
                "optimizer": choices("train", "optimizer"),
                "prior_loss": choices("data", "prior_loss"), "ema": ["off", "on"],
                "lr_scheduler": choices("train", "lr_scheduler"),
                "timestep_sampling": choices("train", "timestep_sampling"),
                "dtype": choices("model", "dtype"), "mixed_precision": choices("train", "mixed_precision"),
                "base_format": _auto_first(choices("memory", "base_format")),
                "expert": _auto_first(choices("model", "expert")), "lora_experts": choices("lora", "experts"),
                "image_to_video": ["off", "on"],
                "plan_gpu": [{"value": "", "title": "this machine's GPU (none: an RTX 4090-class card)"}]
                            + [{"value": k, "title": t} for k, t in gpu_cards().items()],
                "defaults": RunForm().as_fields(), "runs_dir": str(runs_dir),
                "data_roots": [str(r) for r in roots], "stock_models": plan_answer.stock_models(),
                "max_upload_bytes": dataset_view.MAX_UPLOAD_BYTES}

    @app.get("/api/dataset")
    def get_dataset(path: str, min_resolution: int | None = None, target_fps: float | None = None,
                    max_frames: int | None = None, family: str | None = None):
        """The dataset view; a clip's trained frames at the form's clip frame rate and longest clip
        (no rate given: the video family's own, as the trainer takes it: cache.family_clip_rate)."""
        with on_form(default="dataset"):
            if target_fps is None and family in families():
                from ..models.family import get_family

                video = get_family(family).video
                target_fps = video.fps if video is not None else None
            if target_fps is not None and not target_fps > 0:
                raise FormError(f"target_fps: a frame rate above 0, got {target_fps:g}")
            if max_frames is not None and max_frames < 1:
                raise FormError(f"max_frames: at least 1 frame, got {max_frames}")
            return {"folder": str(dataset_view.folder_of(path, roots)),
                    "images": dataset_view.scan(path, min_resolution, roots, target_fps, max_frames)}

    @app.post("/api/tokens")
    def post_tokens(body: dict):
        """Each caption's tokens as the trainer counts them, against the form's Text tokens (tokens.py)."""
        from . import tokens

        texts = body.get("texts") or []
        with on_form(default="max_text_length"):
            if not isinstance(texts, list):
                raise ValueError("max_text_length: the captions to count are a list")
            try:
                limit = int(body.get("max_text_length") or 0)
            except (TypeError, ValueError):
                limit = 0
            if limit < 1:
                raise ValueError(f"max_text_length: a whole number of tokens >= 1, got {body.get('max_text_length')!r}")
        return tokens.count([str(t) for t in texts], str(body.get("model_path", "")), str(body.get("family", "")),
                            limit, str(body.get("trigger_word", "")))

    @app.get("/api/dataset/image")
    def get_image(path: str, name: str):
        return FileResponse(dataset_view.preview_path(path, name, roots))     # a sequence: its first frame

    @app.get("/api/dataset/thumb")
    def get_thumb(path: str, name: str):
        """The image's thumbnail (thumbs.py), checked as the full image is, kept under the runs folder."""
        from fastapi.responses import Response

        from . import thumbs

        with on_form(default="dataset"):
            image = dataset_view.preview_path(path, name, roots)
        data = thumbs.thumbnail(image, runs_dir / thumbs.FOLDER)
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "private, max-age=3600"})

    @app.put("/api/dataset/image")
    async def put_image(path: str, name: str, request: Request):
        with on_form(default="dataset"):
            dataset_view.folder_of(path, roots)          # refuse before reading a byte of the body
        data = await _body(request, dataset_view.MAX_UPLOAD_BYTES, name)      # per file: the page lists each refusal
        return {"written": str(await asyncio.to_thread(dataset_view.save_upload, path, name, data, roots))}

    @app.post("/api/dataset/remove")
    def post_remove(body: dict):
        """Ticked images out of the dataset, moved (with their captions) into its hidden .removed/."""
        with on_form(default="dataset"):
            names = body.get("names") or []
            if not isinstance(names, list):
                raise ValueError("the images to remove are a list of names")
            return dataset_view.remove_images(str(body.get("path", "")), [str(n) for n in names], roots)

    @app.post("/api/caption")
    def post_caption(body: dict):
        written = dataset_view.write_caption(str(body.get("path", "")), str(body.get("name", "")),
                                             str(body.get("caption", "")), roots)
        return {"written": str(written)}

    @app.post("/api/captions")
    def post_captions(body: dict):
        """Bulk caption edits (caption_tools.py) on the selected images, or on all of the folder's."""
        from . import caption_tools

        names = body.get("names") or []
        with on_form(default="dataset"):
            if not isinstance(names, list):
                raise ValueError("caption_op: the selection is a list of image names")
            changed = caption_tools.apply(str(body.get("path", "")), str(body.get("op", "")), str(body.get("text", "")),
                                          str(body.get("find", "")), [str(n) for n in names], roots)
        return {"changed": changed}

    @app.post("/api/caption-job")
    def post_caption_job(body: dict):
        """Caption the folder's images with a local image-to-text model (its own process)."""
        import subprocess
        import sys

        with on_form(default="dataset"):
            folder = dataset_view.folder_of(str(body.get("path", "")), roots)
        model = Path(str(body.get("model", "")).strip()).expanduser()
        if not str(body.get("model", "")).strip() or not model.is_dir():
            with on_form(default="caption_model"):
                given = f"{str(model)!r} is not a folder; " if str(body.get("model", "")).strip() else ""
                raise ValueError(f"{given}give the folder of a local transformers image-to-text model "
                                 f"(BLIP, Florence-2, ...)")
        job = runs_dir / "_captions"
        job.mkdir(exist_ok=True)
        status = job / "status.json"
        if launcher.alive(job):
            raise ValueError("captioning is already running")
        status.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "leantune.ui.captioner", str(model), str(folder), str(status)]
        cmd += ["--all"] if body.get("overwrite") else []
        cmd += ["--prompt", str(body["prompt"])] if str(body.get("prompt", "")).strip() else []
        launcher.start(job, None, command=cmd)           # refuses a second one under the folder's lock
        return {"started": True}

    @app.get("/api/caption-job")
    def get_caption_job():
        job = runs_dir / "_captions"
        try:
            status = json.loads((job / "status.json").read_text())
        except (OSError, ValueError):
            status = {"done": 0, "total": None, "current": "starting", "error": None}
        info = launcher.read_process(job) or {}
        running = launcher.is_alive(info, job)
        if not running and info.get("exit_code") not in (None, 0) and not status.get("error"):
            status["error"] = f"captioning stopped (exit code {info.get('exit_code')}); see {job / launcher.CONSOLE_FILE}"
        return {**status, "running": running}

    @app.post("/api/toml")
    def post_toml(body: dict):
        """The form's TOML, checked as `leantune train` checks it. A model or image folder not given
        yet is no error here (the page's checklist says what is missing; Start refuses it)."""
        with on_form(body):
            form = RunForm.from_fields(body, complete=False)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                form.write(Path(tmp) / "config.toml")
            except ValueError as e:
                said = labels.on_field(str(e).replace(str(Path(tmp) / "config.toml"), "the config"), form.extra_toml)
                return {"toml": form.to_toml(), **said}
        return {"toml": form.to_toml(), "error": None, "field": None}

    @app.get("/api/presets")
    def get_presets():
        return {"presets": sorted(presets())}

    @app.post("/api/import")
    def post_import(body: dict):
        """A TOML (a preset by name, or text the user chose) as the form's fields, keeping the
        current form's paths where the TOML's are relative to a file the page cannot see."""
        with on_form(body.get("fields") or {}):
            keep = RunForm.from_fields(body.get("fields") or {}, complete=False)
        if body.get("preset"):
            found = presets().get(str(body["preset"]))
            if found is None:
                raise ValueError(f"no preset named {body['preset']!r}")
            text = found.read_text()
        else:
            text = str(body.get("toml", ""))
        with on_form(default="preset" if body.get("preset") else "import-toml"):
            form, notes = RunForm.from_toml(text, keep)
        notes = [labels.on_field(n)["error"] for n in notes]                # the page's words
        missing = plan_answer.missing_model(form.model_path, form.family)   # a preset's folder not here
        if missing:
            notes.append(missing["note"])
        return {"fields": form.as_fields(), "notes": notes, "stock": missing["stock"] if missing else None}

    @app.get("/api/runs/{name}/form")
    def get_run_form(name: str):
        """A run's config as the form's fields: clone it."""
        form, notes = RunForm.from_toml((_existing(name) / runs.CONFIG_FILE).read_text())
        return {"fields": form.as_fields(), "notes": [labels.on_field(n)["error"] for n in notes]}

    @app.post("/api/plan")
    def post_plan(body: dict):
        """The plan of the form; the image folder is not needed (the planner prices the model,
        the resolutions and the budgets), and a form without a model or budget yet is told what
        the plan waits for, not refused."""
        with on_form(body):
            form = RunForm.from_fields(body, complete=False)
            if not form.model_path.strip():
                return {"fits": None, "message": "give a model (a folder, a .safetensors file or a stock name) "
                                                 "to see the plan"}
            if not form.vram_budget.strip():
                return {"fits": None, "message": "set a VRAM budget to see the plan"}
            return _plan(form)

    def _plan(form: RunForm) -> dict:
        """The planner's answer for the form. A form the config check refuses is an error (HTTP 400);
        a config the planner declines to plan (a mode or family it does not price yet, "auto" with
        no GPU here) is its answer, shown as such: {"fits": None, "planned": False, "message": ...}."""

        text = form.to_toml()
        ram, ram_words = plan_answer.ram_argument(form.ram_budget)
        key = (text, ram, form.plan_gpu)
        if key not in plans:
            stock = None
            if form.model_path.strip() in plan_answer.stock_models():
                stock = {"model": form.model_path.strip(), "mode": form.mode, "rank": form.rank,
                         "resolutions": form.resolutions, "text_length": form.max_text_length,
                         "batch_size": form.batch_size}
                if FAMILIES[form.family].video:     # a video model trains on clips: priced at the longest
                    stock["frames"] = form.max_frames
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    config = form.write(Path(tmp) / "config.toml")
                except ConfigError as e:       # a key the config check refuses: an error, named without the temp path
                    raise ConfigError(str(e).replace(str(Path(tmp) / "config.toml"), "the config")) from None
                try:
                    answer = plan_answer.plan_json(None if stock else config, form.vram_budget.strip(), ram, stock,
                                                   gpu=form.plan_gpu)
                except ValueError as e:        # ConfigError and the planner's refusals; the form passed
                    said = labels.on_field(plan_answer.page_words(str(e).replace(tmp, "(the form)")), form.extra_toml)
                    return {"fits": None, "planned": False, "message": "not planned: " + said["error"],
                            "field": said["field"]}
                summary = plan_answer.summarize(answer, form.steps, ram_words)
                from ..config import parse_size

                summary["ram_budget_gib"] = parse_size(ram) / 2**30 if ram else None    # the host RAM bar's scale
                if summary["fits"] and summary["assumed_machine"] and not system.gpus():
                    # the time is a GPU's: said so where the run would train on this machine's CPU
                    summary["words"] += ("; this machine has no GPU, so a run here trains on the CPU, many times "
                                         "slower" + ("" if form.plan_gpu else " (choose your GPU under “Plan for GPU”)"))
                plans[key] = summary
        return plans[key]

    @app.get("/api/runs")
    def get_runs():
        return {"runs": runs.listing(runs_dir)}

    @app.post("/api/runs")
    def post_run(body: dict):
        with on_form(body):
            form = RunForm.from_fields(body)
            if form.model_path.strip() in plan_answer.stock_models():
                raise ValueError(f"model_path: {form.model_path!r} is a stock architecture the page plans without "
                                 f"weights; give the model's folder or .safetensors file to train")
        with on_form(body, default="dataset"):
            dataset_view.folder_of(form.dataset, roots)       # the trainer reads only folders the page may use
        with on_form(body):
            folder = runs.run_folder(runs_dir, form.name)
            if folder.exists():
                raise ValueError(f"name {form.name!r}: a run of that name exists in {runs_dir}; pick another "
                                 f"name, or resume it")
        folder.mkdir(parents=True)
        try:
            with on_form(body):
                config = form.write(folder / runs.CONFIG_FILE)
                _confined(folder)                # every path of the merged config, not only the form's dataset
        except Exception:
            shutil.rmtree(folder)           # a refused form leaves no half-made run behind
            raise
        if form.vram_budget.strip():
            from ..io import atomic_write_json

            atomic_write_json(folder / runs.PLAN_FILE, _plan(form))
        return queue.submit(runs_dir, folder, resume=False)

    def _confined(folder: Path, config: str = runs.CONFIG_FILE) -> None:
        """The run's config as `leantune train` loads it, every path under the roots its key may use,
        and every link its datasets' scan follows under the data roots (links.py)."""
        from ..config import load_config

        cfg = load_config(folder / config)
        confine.check(cfg, roots, folder, runs_dir)
        links.check(cfg, roots)

    @app.post("/api/check")
    def post_check(body: dict):
        """`leantune check` on the form's config (check_job.py): the form as Start takes it, checked
        and confined as a run's config is, then run alone on the machine."""
        from . import check_job

        with on_form(body):
            form = RunForm.from_fields(body)
            if form.model_path.strip() in plan_answer.stock_models():
                raise ValueError(f"model_path: {form.model_path!r} is a stock architecture the page plans without "
                                 f"weights; give the model's folder or .safetensors file to check")
        with on_form(body, default="dataset"):
            dataset_view.folder_of(form.dataset, roots)
        job = check_job.folder(runs_dir)
        job.mkdir(exist_ok=True)
        if launcher.alive(job):
            raise ValueError("the check is already running")
        with on_form(body):
            config = form.write(job / check_job.CONFIG)
            _confined(job, check_job.CONFIG)
        for name in (check_job.LINES, launcher.CONSOLE_FILE):
            (job / name).unlink(missing_ok=True)
        queue.start_alone(runs_dir, job, check_job.command(config))
        return {"started": True}

    @app.get("/api/check")
    def get_check():
        from . import check_job

        return check_job.status(runs_dir)

    def _existing(name: str) -> Path:
        folder = runs.run_folder(runs_dir, name)
        if not (folder / runs.CONFIG_FILE).is_file():
            raise ValueError(f"no run named {name!r} in {runs_dir}")
        return folder

    @app.post("/api/runs/{name}/stop")
    def post_stop(name: str):
        """Stop a running run (it saves), or take a queued one out of the line."""
        folder = _existing(name)
        if queue.leave(folder):
            return {"left_queue": name}
        return launcher.stop(folder)

    @app.post("/api/runs/{name}/resume")
    def post_resume(name: str):
        folder = _existing(name)
        _confined(folder)                    # a config written by hand, or by a page before this check
        return queue.submit(runs_dir, folder, resume=True)

    @app.delete("/api/runs/{name}")
    def delete_run(name: str):
        """Delete a run with its files (the page asks first); a running one must be stopped first."""
        folder = _existing(name)
        with launcher.run_lock(folder):
            if launcher.alive(folder):
                raise ValueError(f"{name}: running; stop it first")
            shutil.rmtree(folder)
        return {"deleted": name}

    @app.get("/api/system")
    def get_system():
        return system.snapshot()

    @app.on_event("startup")
    def start_queue():
        queue.keep_moving(runs_dir)

    @app.get("/api/runs/{name}")
    def get_run(name: str):
        return runs.progress(_existing(name))

    @app.get("/api/runs/{name}/events")
    async def run_events(name: str):
        folder = _existing(name)

        async def stream():
            last = None
            while True:
                data = json.dumps(await asyncio.to_thread(runs.progress, folder))
                if data != last:
                    yield f"data: {data}\n\n"
                    last = data
                await asyncio.sleep(1.0)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/api/runs/{name}/config.toml")
    def get_config(name: str):
        return FileResponse(_existing(name) / runs.CONFIG_FILE, filename=f"{name}.toml", media_type="application/toml")

    @app.get("/api/runs/{name}/samples.zip")
    def get_samples_zip(name: str):
        """Every sample of the run (grids, videos and their previews) in one zip."""
        return FileResponse(runs.samples_zip(_existing(name)), filename=f"{name}-samples.zip",
                            media_type="application/zip")

    @app.get("/api/runs/{name}/samples/{file}")
    def get_sample(name: str, file: str, prompt: int | None = None):
        """A sample grid, or with ?prompt=i the image of prompt i in it (the gallery's cells)."""
        if prompt is None:
            return _file(_existing(name) / runs.RUN_DIR / "samples", file, download=False)
        from fastapi.responses import Response

        return Response(runs.sample_tile(_existing(name), file, prompt), media_type="image/png")

    @app.get("/api/runs/{name}/weights/{file}")
    def get_weights(name: str, file: str):
        return _file(_existing(name) / runs.RUN_DIR, file, download=True)

    @app.post("/api/sample")
    def post_sample(body: dict):
        with on_form(body, form="sample"):
            return sample_job.start(runs_dir, body)

    @app.get("/api/runs/{name}/sample-fields")
    def get_run_sample_fields(name: str):
        """"Sample this run": the Sample form filled from the run's config and newest LoRA."""
        return sample_job.run_fields(_existing(name))

    @app.get("/api/model-family")
    def get_model_family(path: str):
        """The family a model path's metadata names (null when nothing says): the Sample form's
        "from the model" choice."""
        return {"family": sample_job.model_family(path)}

    @app.get("/api/sample/{job}")
    def get_sample_job(job: int):
        return sample_job.result(runs_dir, job)

    @app.get("/api/sample/{job}/{file}")
    def get_sample_image(job: int, file: str):
        return _file(runs_dir / sample_job.SAMPLES_DIR / str(job), file, download=False)

    return app


def _auto_first(values: list[str]) -> list[str]:
    """A choice list with "auto" (the planner decides) first, as the page offers it."""
    return sorted(values, key=lambda v: v != "auto")


async def _body(request: Request, limit: int, name: str) -> bytes:
    """The request body, refused (TooLarge) as soon as it passes `limit` bytes: a declared length
    over it is refused before reading, and a body sent without one stops being read at the limit."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"{name}: {int(declared) / 2**20:.0f} MiB, more than the {limit // 2**20} MiB an upload may be")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"{name}: more than the {limit // 2**20} MiB an upload may be")
        chunks.append(chunk)
    return b"".join(chunks)


def _file(folder: Path, name: str, download: bool):
    path = folder / Path(name).name
    if name != Path(name).name or not path.is_file():
        return PlainTextResponse("not found", 404)
    return FileResponse(path, filename=name if download else None)


def serve(runs_dir: Path, host: str, port: int, token: str, data_roots: list[Path] | None = None,
          allowed_hosts: set[str] | None = None) -> None:
    import uvicorn

    uvicorn.run(create_app(runs_dir, token, data_roots, allowed_hosts), host=host, port=port, log_level="warning")

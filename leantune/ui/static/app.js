// The leantune page: plain DOM calls over the /api routes of leantune/ui/app.py.
const $ = (id) => document.getElementById(id);
const FORM = ["name", "model_path", "family", "expert", "lora_experts", "image_to_video", "mode", "dtype", "mixed_precision", "dataset", "trigger_word", "repeats",
  "caption_dropout", "mask_folder", "mask_floor", "prior_folder", "prior_caption", "prior_loss", "prior_ratio", "rank", "lora_type", "lora_targets", "resolutions", "batch_size", "max_text_length", "target_fps", "max_frames", "steps", "learning_rate",
  "optimizer", "lr_scheduler", "warmup_steps", "timestep_sampling", "seed", "save_every", "log_every",
  "vram_budget", "ram_budget", "plan_gpu", "base_format", "max_base_error", "sample_every", "sample_steps", "sample_size", "sample_guidance", "sample_seed",
  "sample_frames", "sample_references", "sample_prompts", "ema", "ema_decay", "validation_fraction", "validation_every", "extra_toml"];
const CHOICES = ["family", "expert", "lora_experts", "image_to_video", "mode", "dtype", "mixed_precision", "base_format", "lora_type", "prior_loss", "ema", "lora_targets", "optimizer", "lr_scheduler", "timestep_sampling"];
const STORE = "leantune-form";
// the fields outside the run form a reload keeps as well (the caption writer, the Sample form)
const KEPT = ["caption_model", "caption_prompt", "s_model", "s_family", "s_prompts", "s_negative", "s_seed", "s_steps",
  "s_guidance", "s_width", "s_height", "s_vram", "s_text_length", "s_dtype", "s_loras", "s_frames"];
let watching = null, events = null;
// the session secret the server put in the page: every change carries it in a header, which no other
// site's page can set (the server refuses changes without it)
const TOKEN = document.querySelector('meta[name="leantune-token"]').content;

async function api(method, url, body) {
  const r = await fetch(url, {method, headers: {"Content-Type": "application/json", "X-Leantune-Token": TOKEN},
                              body: body === undefined ? undefined : JSON.stringify(body)});
  let data;
  try { data = await r.json(); } catch (e) { throw new Error(`${r.status} ${r.statusText}`); }
  if (!r.ok) {
    // the server names the field an error is about (labels.py): {error, field, problems?}
    const e = new Error(data.error || r.statusText);
    e.field = data.field || null;
    e.problems = data.problems || (data.field ? [{error: data.error, field: data.field}] : []);
    throw e;
  }
  return data;
}

// -- errors beside their field ------------------------------------------------------------------------
// Each error is shown once, beside the field it is about (aria-invalid, and aria-describedby pointing at
// the message), from two sources: the live check of the form as it is typed ("preview") and the last
// action the user took (Start, Load, Caption, Sample: "action"). Only an action moves the focus, to
// the field: the live check never takes the cursor from where the user is typing.
const fieldErrors = {preview: [], action: []};
function labelOf(id) {
  const l = document.querySelector(`label[for="${id}"]`);
  return l ? l.textContent.trim() : id;
}
function showFieldErrors(source, problems, focus = false) {
  fieldErrors[source] = (problems || []).filter((p) => p.field && $(p.field));
  for (const box of document.querySelectorAll(".field-error")) {
    const c = $(box.id.slice(0, -"-error".length));
    box.hidden = true; box.textContent = "";
    if (!c) continue;
    c.removeAttribute("aria-invalid");
    const ids = (c.getAttribute("aria-describedby") || "").split(" ").filter((x) => x && x !== box.id);
    if (ids.length) c.setAttribute("aria-describedby", ids.join(" ")); else c.removeAttribute("aria-describedby");
  }
  const seen = new Set();
  for (const p of [...fieldErrors.action, ...fieldErrors.preview]) {
    if (seen.has(p.field)) continue;            // one message a field
    seen.add(p.field);
    const c = $(p.field);
    let box = $(p.field + "-error");
    if (!box) {
      box = el("p", {id: p.field + "-error", className: "field-error"});
      (c.closest(".field") || c.parentElement).append(box);
    }
    box.textContent = p.error; box.hidden = false;
    c.setAttribute("aria-invalid", "true");
    const ids = (c.getAttribute("aria-describedby") || "").split(" ").filter(Boolean);
    c.setAttribute("aria-describedby", [...ids, box.id].join(" "));
    const folded = c.closest("details");
    if (folded) folded.open = true;               // an error inside "Advanced" opens it
  }
  if (focus && fieldErrors[source].length) {
    const c = $(fieldErrors[source][0].field);
    c.scrollIntoView({block: "center"});
    c.focus();
  }
  updateChecklist();
}
// an action's error: beside its field (focused) when it names one, else in the action's own line;
// returns what that line should say
function actionError(e, fallback, focus = true) {
  if (e.field && $(e.field)) {
    showFieldErrors("action", e.problems.length ? e.problems : [{error: e.message, field: e.field}], focus);
    return fallback;
  }
  return e.message;
}
// the form survives a reload: every change is kept in this browser's storage
function resolutionsChosen() { return localStorage.getItem(STORE + "-resolutions") === "chosen"; }
function chooseResolutions() { try { localStorage.setItem(STORE + "-resolutions", "chosen"); } catch (e) { /* private mode */ } }
function saveForm() { try { localStorage.setItem(STORE, JSON.stringify(formFields())); } catch (e) { /* private mode */ } }
function saveKept() {
  try { localStorage.setItem(STORE + "-more", JSON.stringify(Object.fromEntries(KEPT.map((k) => [k, $(k).value])))); }
  catch (e) { /* private mode */ }
}
function restoreKept() {
  let kept = {};
  try { kept = JSON.parse(localStorage.getItem(STORE + "-more") || "{}"); } catch (e) { kept = {}; }
  for (const k of KEPT) if (typeof kept[k] === "string") $(k).value = kept[k];
}
function setFields(fields) {
  if ("resolutions" in fields) chooseResolutions();
  for (const [k, v] of Object.entries(fields)) {
    if (!$(k) || v === null || v === undefined) continue;
    $(k).value = Array.isArray(v) ? (k === "sample_prompts" ? v.join("\n") : v.join(" ")) : v;
  }
  modeChanged();
  saveForm();
  schedulePlan();
}
function fmtTime(s) {
  if (s === null || s === undefined) return "?";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h} h ${m} min` : m ? `${m} min ${sec} s` : `${sec} s`;
}
function status(text) { $("status").textContent = text; }
function formFields() {
  const out = {};
  for (const k of FORM) out[k] = $(k).value;
  return out;
}
function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  Object.assign(e, attrs);
  if (text !== undefined) e.textContent = text;
  return e;
}

// -- 1. dataset -------------------------------------------------------------------------------------
let datasetShown = {path: null, count: 0}, datasetLoading = null;
function loadDataset(focus = true) {
  // one load at a time per folder: a Load click that also blurs the field (change) loads once; a
  // load the user did not ask for by a click (leaving the field, a reload) never moves the cursor
  const path = $("dataset").value;
  if (datasetLoading && datasetLoading.path === path) return datasetLoading.done;
  datasetLoading = {path, done: loadDatasetNow(path, focus).finally(() => { datasetLoading = null; })};
  return datasetLoading.done;
}
async function loadDatasetNow(path, focus) {
  // the "smaller than the training resolution" warning only once the resolutions are the user's
  // (typed, imported or kept from before), never from the default they have not chosen yet
  const res = resolutionsChosen() ? Math.min(...$("resolutions").value.split(/[ ,]+/).filter(Boolean).map(Number)) || 0 : 0;
  try {
    const fps = Number($("target_fps").value), frames = Number($("max_frames").value);    // a clip's trained frames
    const data = await api("GET", `/api/dataset?path=${encodeURIComponent(path)}` + (res ? `&min_resolution=${res}` : "") +
                           (fps > 0 ? `&target_fps=${fps}` : `&family=${encodeURIComponent($("family").value)}`) +
                           (frames >= 1 ? `&max_frames=${frames}` : ""));
    const grid = $("grid");
    grid.replaceChildren();
    let warned = 0;
    for (const img of data.images) {
      const item = el("div", {className: "item"});
      item.dataset.name = img.name;
      // a thumbnail made and kept by the server; the full image only when enlarged
      const where = `path=${encodeURIComponent(data.folder)}&name=${encodeURIComponent(img.name)}`;
      const thumb = el("img", {src: `/api/dataset/thumb?${where}`, loading: "lazy", tabIndex: 0,
                               alt: img.caption ? `${img.name}: ${img.caption}` : img.name});
      thumb.setAttribute("role", "button");
      // an image opens full size; a clip plays in place (the file itself, with its controls)
      thumb.onclick = () => { viewer = null; $("enlarge-step").hidden = true; enlargeFile(`/api/dataset/image?${where}`, img.kind === "clip" && !img.sequence, thumb.alt); };
      thumb.onkeydown = (ev) => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); thumb.onclick(); } };
      item.append(thumb);
      item.dataset.kind = img.kind || "image";
      item.append(el("div", {}, `${img.name} ${img.width ?? "?"}×${img.height ?? "?"}`));
      if (img.kind === "clip") item.append(el("div", {className: "clip-info"}, clipWords(img)));
      const caption = el("textarea", {className: "caption", rows: 3, value: img.caption});
      caption.dataset.name = img.name;
      caption.setAttribute("aria-label", `caption of ${img.name}`);
      const note = el("div", {className: "note", role: "status"});
      const count = el("div", {className: "tokens"});
      count.id = `tokens-${grid.children.length}`;
      caption.setAttribute("aria-describedby", count.id);
      let saved = img.caption, timer = null;
      const save = async () => {
        clearTimeout(timer);
        if (caption.value === saved) return;
        const text = caption.value;
        try {
          await api("POST", "/api/caption", {path: data.folder, name: img.name, caption: text});
          saved = text; note.className = "note saved"; note.textContent = "saved";
          countTokens([item]);
        } catch (e) { note.className = "note warn"; note.textContent = e.message; }
      };
      // saved when typing pauses (and on leaving the box), so a closed tab loses nothing typed
      caption.addEventListener("input", () => { note.textContent = "…"; note.className = "note"; clearTimeout(timer); timer = setTimeout(save, 700); });
      caption.addEventListener("change", save);
      const pick = el("input", {type: "checkbox", className: "pick"});
      pick.setAttribute("aria-label", `select ${img.name}`);
      const pickLabel = el("label", {className: "pick-label"});      // a 44 px target around the box
      pickLabel.append(pick, " select");
      item.append(caption, count, note, pickLabel);
      for (const w of img.warnings) { item.append(el("div", {className: "warn"}, "⚠ " + w)); }
      if (img.warnings.length) warned++;
      item.dataset.warned = img.warnings.length ? "yes" : "no";
      grid.append(item);
    }
    const clipCount = data.images.filter((i) => i.kind === "clip").length;
    $("dataset-summary").textContent = `${data.images.length - clipCount} images` + (clipCount ? ` and ${clipCount} clips` : "") +
      ` in ${data.folder}` + (warned ? `, ${warned} with warnings` : "");
    filterGrid();
    countTokens();
    datasetShown = {path, count: data.images.length};
    if (fieldErrors.action.some((p) => p.field === "dataset")) showFieldErrors("action", []);
    setView({dataset: path}, false);
    schedulePlan();
  } catch (e) {
    datasetShown = {path: null, count: 0};
    $("grid").replaceChildren();
    $("dataset-summary").textContent = actionError(e, "", focus);
  }
  updateChecklist();
}

function clipWords(c) {
  // what the trainer makes of a clip: its source frames and seconds, the frames it trains
  const kind = c.sequence ? "image sequence" : "video clip";
  if (c.frames === null || c.frames === undefined) return kind;
  return `${kind} · ${c.frames} frames · ${c.duration_s.toFixed(1)} s at ${Number(c.fps.toFixed(2))} fps` +
    (c.train_frames ? ` · trains ${c.train_frames} frames` : "");
}
function enlargeFile(src, video, words) {
  // the enlarge dialog shows an image, or plays a clip in place
  $("enlarged").hidden = video; $("enlarged-video").hidden = !video;
  if (video) { $("enlarged-video").src = src; $("enlarged-video").setAttribute("aria-label", words); $("enlarged").removeAttribute("src"); }
  else { $("enlarged-video").removeAttribute("src"); $("enlarged").src = src; $("enlarged").alt = words; }
  $("enlarged-caption").textContent = words;
  if (!$("enlarge").open) $("enlarge").showModal();       // the viewer moves within an open dialog
}
// each caption's tokens as the trainer counts them (the model's tokenizer) against Text tokens:
// a caption past the limit is marked, since the trainer cuts it there
let tokenSeq = 0, tokenTimer = null;
function scheduleTokens() { clearTimeout(tokenTimer); tokenTimer = setTimeout(() => countTokens(), 600); }
async function countTokens(items) {
  const all = !items, seq = all ? ++tokenSeq : tokenSeq;
  items = items || [...$("grid").children];
  if (!items.length) { $("token-note").textContent = ""; return; }
  const limit = Number($("max_text_length").value);
  try {
    const r = await api("POST", "/api/tokens", {texts: items.map((i) => i.querySelector(".caption").value),
      model_path: $("model_path").value, family: $("family").value, max_text_length: $("max_text_length").value,
      trigger_word: $("trigger_word").value});
    if (all && seq !== tokenSeq) return;
    items.forEach((item, k) => {
      const box = item.querySelector(".tokens"), n = r.counts ? r.counts[k] : null;
      item.dataset.tokens = n === null ? "" : String(n);
      box.className = "tokens" + (n !== null && n > limit ? " warn" : "");
      // a family that cuts nothing (r.cuts false) trains the whole caption: over the limit costs memory the plan did not price
      const past = r.cuts === false ? "longer than the plan prices" : `the trainer cuts it to ${limit}`;
      box.textContent = n === null ? "" : n > limit ? `⚠ ${n} tokens: ${past} (Text tokens)` : `${n} / ${limit} tokens`;
    });
    const over = [...$("grid").children].filter((i) => i.dataset.tokens && Number(i.dataset.tokens) > limit).length;
    const them = r.cuts === false ? "the plan prices less" : "the trainer cuts them";
    $("token-note").textContent = r.note + (over ? ` · ${over} caption(s) longer than Text tokens (${limit}): ${them}` : "");
    $("token-note").className = over ? "warn" : "muted";
  } catch (e) { $("token-note").textContent = e.message; $("token-note").className = "warn"; }
}
function filterGrid() {
  // "only images with warnings": the ones the trainer would skip or shrink, to fix first
  const only = $("only-warned").checked;
  for (const item of $("grid").children) item.hidden = only && item.dataset.warned !== "yes";
}
async function upload(files) {
  // Each file is checked by the server (decodes as an image, name not taken); a refused one is
  // reported and the others still land. `files`: chosen with "Add images" or dropped on the grid.
  const folder = $("dataset").value, refused = [];
  let added = 0;
  for (const f of files) {
    if (f.size > maxUpload) { refused.push(`${f.name}: ${(f.size / 2 ** 20).toFixed(0)} MiB, more than the ${maxUpload / 2 ** 20} MiB an upload may be`); continue; }
    const r = await fetch(`/api/dataset/image?path=${encodeURIComponent(folder)}&name=${encodeURIComponent(f.name)}`,
                          {method: "PUT", body: f, headers: {"X-Leantune-Token": TOKEN}});
    if (r.ok) added++; else refused.push(await r.json().then((d) => d.error, () => `${f.name}: refused (${r.status})`));
  }
  $("upload").value = "";
  await loadDataset(false);
  const note = $("upload-message");
  note.className = refused.length ? "warn" : "saved";
  note.replaceChildren(el("div", {}, `${added} image(s) added`), ...refused.map((m) => el("div", {}, "refused: " + m)));
}

// -- 2. plan ------------------------------------------------------------------------------------------
let planTimer = null, planSeq = 0, planFits = null;
function schedulePlan() { clearTimeout(planTimer); planTimer = setTimeout(updatePlan, 600); }
async function updatePlan() {
  const seq = ++planSeq;
  const fields = formFields();
  let refused = null;              // the field the live check refuses: the plan waits for it
  try {
    const t = await api("POST", "/api/toml", fields);
    if (seq !== planSeq) return;
    $("toml").textContent = t.toml;
    const problems = t.problems || (t.error ? [{error: t.error, field: t.field}] : []);
    showFieldErrors("preview", problems);
    $("toml-error").textContent = problems.filter((p) => !p.field || !$(p.field)).map((p) => p.error).join("\n");
    refused = problems.find((p) => p.field && $(p.field)) || null;
    $("toml-download").href = URL.createObjectURL(new Blob([t.toml], {type: "application/toml"}));
  } catch (e) {
    if (seq !== planSeq) return;
    $("toml").textContent = "";
    showFieldErrors("preview", e.problems);
    $("toml-error").textContent = e.field && $(e.field) ? "" : e.message;
    refused = e.field && $(e.field) ? {field: e.field, error: e.message} : {field: null, error: e.message};
  }
  if (refused) { showPlan({fits: null, message: refused.field ? `the plan waits for ${labelOf(refused.field)} (marked above)` : "the plan waits for the config to be fixed"}); return; }
  if (!fields.model_path.trim()) { showPlan({fits: null, message: "give a model (a folder, a .safetensors file or a stock name) to see the plan"}); return; }
  if (!fields.vram_budget.trim()) { showPlan({fits: null, message: "set a VRAM budget to see the plan"}); return; }
  $("plan-message").textContent = "planning…";
  try {
    const plan = await api("POST", "/api/plan", fields);
    if (seq === planSeq) showPlan(plan);
  } catch (e) {
    if (seq !== planSeq) return;
    if (e.field && $(e.field)) { showFieldErrors("preview", e.problems); showPlan({fits: null, error: true, message: `the plan waits for ${labelOf(e.field)} (marked above)`}); }
    else showPlan({fits: null, error: true, message: e.message});
  }
}
function gib(x) { return x < 0.1 ? (x * 1024).toFixed(1) + " MiB" : x.toFixed(2) + " GiB"; }
function showPlan(p) {
  // fits (green) · does not fit, with the smallest budget (red) · the planner declined to plan this
  // config, e.g. a mode it does not price yet (its own words, amber) · a field the config refuses.
  $("plan").className = "plan " + (p.fits === true ? "fits" : p.fits === false ? "nofit" :
                                   p.planned === false ? "note" : p.error ? "error" : "");
  planFits = p.fits;
  updateChecklist();
  $("plan-words").textContent = p.fits ? p.words : "";      // the plan in words first, then the numbers
  $("plan-message").textContent = p.message;
  const d = $("plan-detail");
  d.replaceChildren();
  if (p.fits === false && p.smallest_budget) {
    // one click takes the smallest budget that fits
    const b = el("button", {id: "take-smallest", type: "button"}, `Use ${p.smallest_budget}`);
    b.onclick = () => { $("vram_budget").value = p.smallest_budget; saveForm(); updatePlan(); };
    d.append(b);
  }
  if (p.ram) d.append(el("p", {className: "muted", id: "plan-ram"}, p.ram));
  if (p.fits === false && p.detail) d.append(el("p", {className: "muted"}, p.detail));
  if (!p.fits) return;
  d.append(el("p", {}, `${p.workload} · streamed blocks ${p.streamed_blocks}/${p.total_blocks} · fp8 ${p.fp8 ? "on" : "off"} · ` +
    `checkpointing ${p.checkpointing} · predicted ${p.step_s.toPrecision(3)} s/step` + (p.assumed_machine ? ` (${p.machine}, assumed rates)` : "")));
  d.append(planBars(p));
  const table = el("table");
  const rows = [["VRAM", p.vram_breakdown_gib], ["host RAM", p.host_breakdown_gib]];
  for (const [title, parts] of rows) {
    const tr = el("tr"); tr.append(el("td", {}, title));
    tr.append(el("td", {}, Object.entries(parts).filter(([, v]) => v > 0).map(([k, v]) => `${k} ${gib(v)}`).join(" · ")));
    table.append(tr);
  }
  d.append(table);
}

const PART_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
function planBars(p) {
  // the predicted peaks against the budgets, each bar split into the engine's parts (scaled to the
  // peak: the parts are measured at their own moments, so their sum is not always the peak)
  const box = el("div", {id: "plan-bars"});
  for (const [kind, title, peak, budget, parts] of [["vram", "VRAM", p.peak_vram_gib, p.budget_gib, p.vram_breakdown_gib],
                                                     ["host", "host RAM", p.peak_host_gib, p.ram_budget_gib, p.host_breakdown_gib]]) {
    if (!peak || !budget) continue;
    const scale = Math.max(budget, peak), entries = Object.entries(parts || {}).filter(([, v]) => v > 0);
    const sum = entries.reduce((a, [, v]) => a + v, 0) || 1;
    const bar = el("div", {className: "bar"});
    bar.dataset.kind = kind;
    bar.setAttribute("role", "img");
    bar.setAttribute("aria-label", `${title}: predicted peak ${gib(peak)} of a ${gib(budget)} budget` +
      (entries.length ? ` (${entries.map(([k, v]) => `${k} ${gib(v)}`).join(", ")})` : ""));
    entries.forEach(([k, v], i) => {
      const part = el("span", {className: "part", title: `${k} ${gib(v)}`});
      part.style.width = `${(100 * (v / sum) * peak / scale).toFixed(2)}%`;
      part.style.background = PART_COLORS[i % PART_COLORS.length];
      part.dataset.part = k;
      bar.append(part);
    });
    const mark = el("span", {className: "budget-mark"});
    mark.style.left = `${(100 * budget / scale).toFixed(2)}%`;
    bar.append(mark);
    box.append(el("div", {className: "bar-title"}, `${title}: ${gib(peak)} of ${gib(budget)}`), bar);
  }
  return box;
}

// -- 3. runs ------------------------------------------------------------------------------------------
async function startRun() {
  $("start-message").textContent = "starting…";
  showFieldErrors("action", []);
  try {
    const r = await api("POST", "/api/runs", formFields());
    $("start-message").textContent = r.started ? "started" :
      `queued (#${r.position} in line; ${r.running.join(", ") || "another job"} is running: one job at a time)`;
    await refreshRuns();
    watch($("name").value);
  } catch (e) { $("start-message").textContent = actionError(e, "not started: see the marked field"); }
}
// -- leantune check before Start -------------------------------------------------------------------------
async function checkPlan() {
  // the form's config through `leantune check`: one line per technique the plan uses, held or not
  const button = $("check");
  if (button.disabled) return;
  showFieldErrors("action", []);
  button.disabled = true; button.setAttribute("aria-busy", "true");
  const done = () => { button.disabled = false; button.removeAttribute("aria-busy"); };
  $("check-lines").replaceChildren();
  $("check-status").textContent = "starting the check…";
  try {
    await api("POST", "/api/check", formFields());
    const poll = async () => {
      try {
        const r = await api("GET", "/api/check");
        $("check-lines").replaceChildren(...r.lines.map((l) => el("li", {className: /: differs|check not done|failed/.test(l) ? "warn" : ""}, l)));
        $("check-status").className = r.error || (r.done && r.rc !== 0) ? "warn" : r.done ? "saved" : "";
        $("check-status").textContent = r.error ? `check: ${r.error}` : r.done ? `check done: ${r.verdict}` :
          `checking… ${r.progress || ""}`;
        if (r.running || (!r.done && !r.error)) setTimeout(poll, 1000); else done();
      } catch (e) { $("check-status").textContent = e.message; done(); }
    };
    poll();
  } catch (e) { $("check-status").textContent = actionError(e, "not checked: see the marked field"); done(); }
}
async function refreshRuns() {
  const data = await api("GET", "/api/runs");
  const body = $("runs").querySelector("tbody");
  body.replaceChildren();
  for (const r of data.runs) {
    const tr = el("tr");
    tr.append(el("td", {}, r.name), el("td", {className: "state"}, r.state), el("td", {}, `${r.step}/${r.total_steps ?? "?"}`));
    const b = el("button", {type: "button"}, "watch"); b.onclick = () => watch(r.name);
    const c = el("button", {type: "button", className: "clone"}, "clone"); c.onclick = () => cloneRun(r.name);
    const d = el("button", {type: "button", className: "delete"}, "delete"); d.onclick = () => deleteRun(r.name);
    d.disabled = r.state === "running";
    const td = el("td"); td.append(b, " ", c, " ", d); tr.append(td);
    body.append(tr);
  }
  const pick = $("s_run"), had = pick.value;
  pick.replaceChildren(el("option", {value: ""}, "(choose a run)"), ...data.runs.map((r) => el("option", {value: r.name}, `${r.name} (${r.state})`)));
  pick.value = data.runs.some((r) => r.name === had) ? had : "";
}
async function cloneRun(name) {
  const r = await api("GET", `/api/runs/${encodeURIComponent(name)}/form`);
  setFields({...r.fields, name: `${name}-copy`});
  $("import-notes").textContent = `cloned from ${name}` + (r.notes.length ? ": " + r.notes.join("; ") : "");
  openSection("model");
}
async function deleteRun(name) {
  if (!confirm(`Delete the run ${name} and all its files (checkpoints, LoRAs, samples)?`)) return;
  try {
    await api("DELETE", `/api/runs/${encodeURIComponent(name)}`);
    status(`deleted ${name}`);
    if (watching === name) { unwatch(); setView({run: null, open: "run"}); }
  } catch (e) { status(e.message); }
  refreshRuns();
}

// -- the checklist by Start ---------------------------------------------------------------------------
let stockModels = [];
function updateChecklist() {
  // what Start still needs, updated as the fields change: "model ✗ · images ✔ · budget ✔ — what to do"
  const box = $("checklist");
  if (!box) return;
  const model = $("model_path").value.trim(), folder = $("dataset").value.trim(), budget = $("vram_budget").value.trim();
  const marked = [...new Set([...fieldErrors.action, ...fieldErrors.preview].map((p) => p.field))];
  const items = [
    ["model", model && !stockModels.includes(model),
     !model ? "give the model's folder or .safetensors file (2 · Model)" : "a stock name only plans: give the model's folder or file to train"],
    ["images", folder && datasetShown.path === $("dataset").value && datasetShown.count > 0,
     !folder ? "give the image folder and Load it (1 · Dataset)" : datasetShown.path === $("dataset").value ? "the folder holds no images" : "Load the image folder (1 · Dataset)"],
    ["budget", budget && planFits !== false && !marked.includes("vram_budget") && !marked.includes("ram_budget"),
     !budget ? "set a VRAM budget to see what fits (2 · Model)" : planFits === false ? "the plan does not fit this budget" : ""],
  ];
  const todo = items.filter(([, ok, why]) => !ok && why).map(([, , why]) => why);
  if (marked.length) todo.push("fix " + marked.map(labelOf).join(", "));
  box.textContent = items.map(([name, ok]) => `${name} ${ok ? "✔" : "✗"}`).join(" · ") + (todo.length ? " — " + todo.join("; ") : " — ready");
  box.className = todo.length ? "checklist missing" : "checklist ready";
}

// -- the view in the address --------------------------------------------------------------------------
// Which run is watched, which section is open and which image folder is shown live in the address's
// hash (#open=watch&run=NAME&dataset=/path), so a reload, Back/Forward and a copied address reopen
// the same view; the last view is also kept in this browser, for a tab opened on the bare address.
const VIEW_STORE = "leantune-view", VIEW_KEYS = ["open", "run", "dataset"];
function readView() {
  const h = new URLSearchParams(location.hash.slice(1)), v = {};
  for (const k of VIEW_KEYS) if (h.get(k)) v[k] = h.get(k);
  return v;
}
function setView(change, push = true) {
  const v = {...readView(), ...change};
  for (const k of Object.keys(v)) if (v[k] === null || v[k] === undefined || v[k] === "") delete v[k];
  const hash = "#" + new URLSearchParams(v).toString();
  if (hash !== (location.hash || "#")) history[push ? "pushState" : "replaceState"](null, "", hash);
  try { localStorage.setItem(VIEW_STORE, JSON.stringify(v)); } catch (e) { /* private mode */ }
  markNav(v.open);
}
function markNav(open) {
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.dataset.section === open) a.setAttribute("aria-current", "true"); else a.removeAttribute("aria-current");
  }
}
function openSection(name, push = true) {
  setView({open: name}, push);
  const s = $(`${name}-section`);
  if (s && !s.hidden) s.scrollIntoView({block: "start"});
}
async function applyView(v) {
  if (v.dataset && v.dataset !== datasetShown.path) {
    $("dataset").value = v.dataset;
    saveForm();
    loadDataset(false);
  }
  if (v.run && v.run !== watching) {
    try { await api("GET", `/api/runs/${encodeURIComponent(v.run)}`); watch(v.run, false); }
    catch (e) { status(e.message); setView({run: null, open: v.open === "watch" ? null : v.open}, false); }
  } else if (!v.run && watching) unwatch();
  markNav(v.open);
  const s = v.open && $(`${v.open}-section`);
  if (s && !s.hidden) s.scrollIntoView({block: "start"});
}
function unwatch() {
  $("watch-section").hidden = true;
  if (events) events.close();
  events = null; watching = null;
}

// -- 4. watch -----------------------------------------------------------------------------------------
function watch(name, record = true) {
  watching = name;
  if (record) setView({run: name, open: "watch"});
  $("watch-section").hidden = false;
  $("watch-name").textContent = name;
  if (events) events.close();
  events = new EventSource(`/api/runs/${encodeURIComponent(name)}/events`);
  events.onmessage = (m) => showProgress(JSON.parse(m.data));
}
function line(s, xs, ys) {
  if (!s.points.length) return "";
  const d = s.points.map(([x, y]) => `${xs(x).toFixed(1)},${ys(y).toFixed(1)}`).join(" ");
  const value = s.value === undefined ? "" : ` data-value="${s.value}"`;
  return `<polyline fill="none" stroke="${s.color}" stroke-width="${s.width || 1.5}" ${s.dash ? 'stroke-dasharray="5,4"' : ""} ` +
    `data-series="${s.name}"${value} points="${d}"><title>${s.label || s.name}</title></polyline>`;
}
function chart(svg, series, maxX, yTitle) {
  const all = series.flatMap((s) => s.points.map((p) => p[1]));
  svg.setAttribute("role", "img");
  if (!all.length) { svg.innerHTML = ""; svg.setAttribute("aria-label", `${yTitle}: no steps yet`); return; }
  let lo = Math.min(...all), hi = Math.max(...all);
  if (hi === lo) { hi += 1; lo -= lo > 1 ? 1 : lo; }
  const xs = (x) => 40 + (x / Math.max(maxX, 1)) * 350, ys = (y) => 185 - ((y - lo) / (hi - lo)) * 170;
  svg.innerHTML = `<line x1="40" y1="185" x2="390" y2="185" stroke="#999"/><line x1="40" y1="15" x2="40" y2="185" stroke="#999"/>` +
    series.map((s) => line(s, xs, ys)).join("") +
    `<text x="2" y="14" font-size="10">${hi.toPrecision(3)}</text><text x="2" y="186" font-size="10">${lo.toPrecision(3)}</text>` +
    `<text x="40" y="198" font-size="10">0</text><text x="200" y="198" font-size="10" class="x-title">step</text><text x="360" y="198" font-size="10">${maxX}</text>` +
    `<text x="2" y="100" font-size="10" class="y-title">${yTitle}</text>`;
  // the chart in words, for a screen reader: each series' last value
  svg.setAttribute("aria-label", `${yTitle} by step: ` + series.filter((s) => s.points.length)
    .map((s) => `${s.label || s.name}: ${s.points[s.points.length - 1][1].toPrecision(3)} at step ${s.points[s.points.length - 1][0]}`).join("; "));
}
function showProgress(p) {
  if (p.name !== watching) return;
  $("watch-state").textContent = p.state;
  $("stop").disabled = !["running", "queued"].includes(p.state);      // a queued run's Stop leaves the line
  $("stop").textContent = p.state === "queued" ? "Leave the queue" : "Stop (finish step, save)";
  $("resume").disabled = !(["stopped", "failed"].includes(p.state) && p.checkpoints.length);
  const steps = p.steps, last = steps[steps.length - 1];
  const maxX = p.total_steps || (last ? last.step : 1);
  $("speed").textContent = last ? `step ${last.step}/${p.total_steps ?? "?"} · loss ${last.loss.toFixed(4)} · ${last.s_it.toFixed(2)} s/it` +
    // the predicted s/it only where it is a prediction for this machine (measured, not assumed rates)
    (p.predicted.step_s && p.predicted.assumed_machine === false ? ` (predicted ${p.predicted.step_s.toPrecision(3)} s/it on this machine)` : "") : "waiting for the first step…";
  const timing = [p.elapsed_s !== null && p.elapsed_s !== undefined ? `elapsed ${fmtTime(p.elapsed_s)}` : "",
                  p.eta_s !== null && p.eta_s !== undefined ? `about ${fmtTime(p.eta_s)} left` : ""].filter(Boolean).join(" · ");
  $("progress").textContent = (p.state === "running" || p.state === "queued" ? `${p.state === "queued" ? "waiting in line" : p.activity}` : p.state) +
    (timing ? " · " + timing : "");
  // the share of the steps done, and when the run would finish at the measured pace
  const bar = $("progress-bar"), done = last ? last.step : 0;
  bar.max = p.total_steps || 1; bar.value = Math.min(done, bar.max);
  const finish = p.eta_s !== null && p.eta_s !== undefined ? new Date(Date.now() + p.eta_s * 1000) : null;
  $("progress-words").textContent = p.total_steps ? `${done} of ${p.total_steps} steps (${Math.floor(100 * done / p.total_steps)}%)` +
    (finish && p.state === "running" ? ` · finishes about ${finish.toLocaleTimeString([], {hour: "2-digit", minute: "2-digit"})}` : "") : "";
  bar.setAttribute("aria-valuetext", $("progress-words").textContent);
  // the raw loss is noisy step to step: drawn faint, with its moving average over it
  const raw = steps.map((s) => [s.step, s.loss]), smooth = [];
  let avg = null;
  for (const [x, y] of raw) { avg = avg === null ? y : 0.9 * avg + 0.1 * y; smooth.push([x, avg]); }
  const losses = [{name: "loss", label: "loss (each step)", points: raw, color: "#9ec5e8"},
                  {name: "loss-smoothed", label: "loss (moving average)", points: smooth, color: "#1f4e8c", width: 2.5}];
  // the held-out loss at fixed noise ([validation]): a smooth curve beside the noisy training loss
  if ((p.validation || []).length) losses.push({name: "validation", points: p.validation, color: "#2ca02c"});
  chart($("loss-chart"), losses, maxX, "loss");
  // measured (solid) against the plan's prediction (dashed): RSS vs host RAM, VRAM peak vs VRAM
  const mem = [{name: "rss", points: steps.filter((s) => s.rss !== null).map((s) => [s.step, s.rss]), color: "#1f77b4"},
               {name: "vram", points: steps.filter((s) => s.vram_peak !== null).map((s) => [s.step, s.vram_peak]), color: "#d62728"}];
  const pv = p.predicted.peak_vram_gib, ph = p.predicted.peak_host_gib;
  if (pv) mem.push({name: "predicted-vram", label: `predicted peak VRAM ${gib(pv)}`, value: pv, points: [[0, pv], [maxX, pv]], color: "#d62728", dash: true});
  if (ph) mem.push({name: "predicted-host", label: `predicted peak host RAM ${gib(ph)}`, value: ph, points: [[0, ph], [maxX, ph]], color: "#1f77b4", dash: true});
  chart($("mem-chart"), mem, maxX, "GiB");
  $("mem-legend").textContent = [pv ? `predicted VRAM ${gib(pv)}` : "", ph ? `predicted host RAM ${gib(ph)}` : "",
    last && last.vram_peak !== null ? `VRAM peak ${gib(last.vram_peak)}` : "", last && last.rss !== null ? `RSS ${gib(last.rss)}` : ""]
    .filter(Boolean).join(" · ") || (p.predicted.message || "no plan for this run (no VRAM budget)");
  const samples = $("samples");
  if (samples.dataset.list !== p.samples.join()) {
    samples.dataset.list = p.samples.join();
    samples.replaceChildren(gallery(p.name, p.gallery));
  }
  finishedLine(p);
  const downloads = $("downloads");
  downloads.replaceChildren(el("li"));
  downloads.firstChild.append(el("a", {href: `/api/runs/${p.name}/config.toml`}, "config.toml"));
  if (p.samples.length) {
    const li = el("li"); li.append(el("a", {href: `/api/runs/${p.name}/samples.zip`}, "all samples (zip)")); downloads.append(li);
  }
  for (const w of p.weights) {
    const li = el("li"); li.append(el("a", {href: `/api/runs/${p.name}/weights/${w}`}, w)); downloads.append(li);
  }
  const log = $("log");
  log.textContent = p.state === "failed" ? p.console : (p.log || p.console);
  log.scrollTop = log.scrollHeight;
  refreshRuns();
}
function finishedLine(p) {
  // a finished run ends with its result: "your LoRA: <file> — sample it — download" (the file
  // "sample this run" takes: the final ComfyUI file, else the newest one)
  const line = $("finished-line");
  const loras = p.weights.filter((w) => w.endsWith("_comfyui.safetensors"));
  const pool = loras.length ? loras : p.weights, final = pool.filter((w) => !w.includes("-step"));
  const file = p.state === "finished" ? (final.length ? final[final.length - 1] : pool[pool.length - 1]) : null;
  const key = file ? `${p.name}/${file}` : "";
  if (line.dataset.key === key) return;          // rebuilt only when it changes: a focused link stays focused
  line.dataset.key = key;
  line.hidden = !file;
  if (!file) { line.replaceChildren(); return; }
  const sampleIt = el("button", {type: "button", id: "sample-it"}, "sample it");
  sampleIt.onclick = async () => { $("s_run").value = p.name; openSection("sample"); await sampleRun(); };
  line.replaceChildren("your LoRA: ", el("strong", {}, file), " — ", sampleIt, " — ",
    el("a", {href: `/api/runs/${encodeURIComponent(p.name)}/weights/${encodeURIComponent(file)}`, id: "download-lora"}, "download"));
}
function gallery(name, g) {
  // rows: the steps a sample was drawn at; columns: the prompts; each cell the prompt's image at that step
  const table = el("table", {id: "gallery"});
  const prompts = g.prompts.length ? g.prompts : ["samples"];
  const head = el("tr"); head.append(el("th", {}, "step"), ...prompts.map((q) => el("th", {}, q)));
  table.append(head);
  g.steps.forEach((s, si) => {
    const tr = el("tr"); tr.append(el("th", {}, String(s.step)));
    if (s.video) {        // a video family's step: one grid video of every prompt, played in place
      const src = `/api/runs/${encodeURIComponent(name)}/samples/${encodeURIComponent(s.file)}`;
      const words = `step ${s.step}: ${prompts.join(" · ")}`;
      const video = el("video", {src, controls: true, loop: true, muted: true, playsInline: true, title: words});
      video.setAttribute("aria-label", words);
      // its controls take clicks (play, seek): a button opens it enlarged, with ←/→ over the steps
      const open = el("button", {type: "button", className: "enlarge-video"}, "enlarge");
      open.setAttribute("aria-label", `enlarge ${words}`);
      open.onclick = () => openViewer(name, g, si, 0);
      const td = el("td", {colSpan: prompts.length}); td.append(video, open); tr.append(td);
      table.append(tr);
      return;
    }
    prompts.forEach((q, i) => {
      const src = `/api/runs/${encodeURIComponent(name)}/samples/${encodeURIComponent(s.file)}` + (g.prompts.length ? `?prompt=${i}` : "");
      const img = el("img", {src, alt: `step ${s.step}: ${q}`, title: `step ${s.step}: ${q}`});
      img.dataset.step = s.step; img.dataset.prompt = i;
      img.onclick = () => openViewer(name, g, si, i);
      // a tile takes the keyboard's focus and opens with Enter or Space, as a button does
      img.tabIndex = 0; img.setAttribute("role", "button");
      img.onkeydown = (ev) => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); img.onclick(); } };
      const td = el("td"); td.append(img); tr.append(td);
    });
    table.append(tr);
  });
  return table;
}
// the enlarged sample as a viewer: ←/→ (or the slider) move over the steps, ↑/↓ over the prompts
let viewer = null;
function openViewer(name, g, si, pi) {
  viewer = {name, g, si, pi};
  showViewer();
  if (!$("enlarge").open) $("enlarge").showModal();
}
function showViewer() {
  const {name, g, si, pi} = viewer, s = g.steps[si], prompts = g.prompts.length ? g.prompts : ["samples"];
  const file = `/api/runs/${encodeURIComponent(name)}/samples/${encodeURIComponent(s.file)}`;
  const words = s.video ? `step ${s.step}: ${prompts.join(" · ")}` : `step ${s.step}: ${prompts[pi]}`;
  if (s.video) enlargeFile(file, true, words);            // a grid video: every prompt at once
  else enlargeFile(file + (g.prompts.length ? `?prompt=${pi}` : ""), false, words);
  $("enlarged-caption").textContent = words +
    (g.steps.length > 1 || prompts.length > 1 ? " · ←/→ steps, ↑/↓ prompts" : "");
  const slider = $("enlarge-step");
  slider.hidden = g.steps.length < 2;
  slider.max = g.steps.length - 1; slider.value = si;
  slider.setAttribute("aria-valuetext", `step ${s.step}`);
}
function viewerKey(ev) {
  if (!viewer) return;
  const prompts = viewer.g.prompts.length || 1, steps = viewer.g.steps.length;
  const move = {ArrowLeft: [-1, 0], ArrowRight: [1, 0], ArrowUp: [0, -1], ArrowDown: [0, 1]}[ev.key];
  if (!move || ev.target === $("enlarge-step") && move[0]) return;      // the slider moves itself
  ev.preventDefault();
  viewer.si = Math.min(steps - 1, Math.max(0, viewer.si + move[0]));
  viewer.pi = Math.min(prompts - 1, Math.max(0, viewer.pi + move[1]));
  showViewer();
}
async function stopRun() {
  try {
    const r = await api("POST", `/api/runs/${watching}/stop`);
    status(r.left_queue ? `${r.left_queue} left the queue` : "stop asked: the run finishes its step and saves");
  } catch (e) { status(e.message); }
}
async function resumeRun() {
  try {
    const r = await api("POST", `/api/runs/${watching}/resume`);
    status(r.started ? "resumed" : `queued (#${r.position} in line: one job at a time)`);
  } catch (e) { status(e.message); }
}

// -- 5. sample ----------------------------------------------------------------------------------------
let cfgFamilies = [], maxUpload = 64 * 2 ** 20;
async function sampleFamilyChanged() {
  // the negative prompt belongs to classifier-free guidance (SD3.5): shown for those families only,
  // the family chosen or, "from the model", the one the model's metadata names
  let family = $("s_family").value;
  if (!family && $("s_model").value) {
    try { family = (await api("GET", `/api/model-family?path=${encodeURIComponent($("s_model").value)}`)).family; }
    catch (e) { family = null; }
  }
  const cfg = cfgFamilies.includes(family);
  $("s_negative_label").hidden = !cfg;
  if (!cfg) $("s_negative").value = "";
}
async function sample() {
  const body = {model_path: $("s_model").value, family: $("s_family").value, prompts: $("s_prompts").value,
    negative_prompt: $("s_negative_label").hidden ? "" : $("s_negative").value, seed: $("s_seed").value,
    steps: $("s_steps").value, guidance: $("s_guidance").value, width: $("s_width").value,
    height: $("s_height").value, vram: $("s_vram").value, loras: $("s_loras").value,
    text_length: $("s_text_length").value, dtype: $("s_dtype").value, frames: $("s_frames").value};
  const button = $("sample");
  if (button.disabled) return;
  button.disabled = true; button.textContent = "Sampling…"; button.setAttribute("aria-busy", "true");
  const done = () => { button.disabled = false; button.textContent = "Sample"; button.removeAttribute("aria-busy"); };
  showFieldErrors("action", []);
  try {
    const job = await api("POST", "/api/sample", body);
    const poll = async () => {
      try {
        const r = await api("GET", `/api/sample/${job.job}`);
        $("sample-console").textContent = r.console;
        $("sample-images").replaceChildren(...r.images.map((f) => el("img", {src: `/api/sample/${job.job}/${f}`, alt: `sample ${f}`})),
          ...(r.videos || []).map((f) => el("video", {src: `/api/sample/${job.job}/${f}`, controls: true, loop: true,
                                                      playsInline: true, ariaLabel: `sample video ${f}`})));
        if (r.running) setTimeout(poll, 1000); else done();
      } catch (e) { $("sample-console").textContent = e.message; done(); }
    };
    poll();
  } catch (e) { $("sample-console").textContent = actionError(e, "not started: see the marked field"); done(); }
}
async function sampleRun() {
  const name = $("s_run").value;
  if (!name) return;
  try {
    const f = await api("GET", `/api/runs/${encodeURIComponent(name)}/sample-fields`);
    const map = {s_model: "model_path", s_family: "family", s_dtype: "dtype", s_text_length: "text_length",
                 s_prompts: "prompts", s_negative: "negative_prompt", s_seed: "seed", s_steps: "steps",
                 s_guidance: "guidance", s_width: "width", s_height: "height", s_loras: "loras",
                 s_frames: "frames"};
    for (const [id, key] of Object.entries(map)) $(id).value = f[key] ?? "";
    saveKept();
    sampleFamilyChanged();
  } catch (e) { $("sample-console").textContent = e.message; }
}

// -- bulk caption edits -------------------------------------------------------------------------------
async function applyCaptionEdit() {
  const names = [...document.querySelectorAll("#grid .item")].filter((i) => i.querySelector(".pick").checked).map((i) => i.dataset.name);
  showFieldErrors("action", []);
  try {
    const r = await api("POST", "/api/captions", {path: $("dataset").value, op: $("caption_op").value, text: $("caption_text").value,
                                                 find: $("caption_find").value, names});
    $("caption-apply-status").textContent = `${r.changed.length} caption(s) changed` + (names.length ? ` of ${names.length} selected` : "");
    await loadDataset(false);
  } catch (e) { $("caption-apply-status").textContent = actionError(e, "not applied: see the marked field"); }
}

// the ticked images out of the dataset: moved, with their captions, into its hidden .removed/ folder
async function removePicked() {
  const names = [...document.querySelectorAll("#grid .item")].filter((i) => i.querySelector(".pick").checked).map((i) => i.dataset.name);
  if (!names.length) { $("remove-status").textContent = "tick the images to remove first"; return; }
  if (!confirm(`Move ${names.length} ticked image(s) and their captions out of the dataset, into its .removed folder? Nothing is deleted.`)) return;
  showFieldErrors("action", []);
  try {
    const r = await api("POST", "/api/dataset/remove", {path: $("dataset").value, names});
    $("remove-status").textContent = `moved ${r.moved.length} file(s) to ${r.to} (move them back to undo)`;
    await loadDataset(false);
  } catch (e) { $("remove-status").textContent = actionError(e, "not removed: see the marked field"); }
}

// -- captioning with a local model --------------------------------------------------------------------
async function captionImages() {
  const button = $("caption-run");
  button.disabled = true;
  showFieldErrors("action", []);
  try {
    await api("POST", "/api/caption-job", {path: $("dataset").value, model: $("caption_model").value,
                                           overwrite: $("caption_overwrite").checked, prompt: $("caption_prompt").value});
    const poll = async () => {
      const r = await api("GET", "/api/caption-job");
      $("caption-status").textContent = r.error ? r.error :
        r.running ? `captioning ${r.done}/${r.total ?? "?"}` + (r.current ? ` (${r.current})` : "") : `captioned ${r.done} image(s)`;
      if (r.running || (r.total === null && !r.error)) setTimeout(poll, 700);
      else { button.disabled = false; if (!r.error) loadDataset(false); }
    };
    poll();
  } catch (e) { $("caption-status").textContent = actionError(e, "not started: see the marked field"); button.disabled = false; }
}

// -- presets and imports ------------------------------------------------------------------------------
async function importToml(body) {
  try {
    const r = await api("POST", "/api/import", {...body, fields: formFields()});
    setFields(r.fields);
    $("import-notes").replaceChildren(r.notes.join("; "));
    if (r.stock) {
      // the preset's model folder is not here: one click plans it under the stock name, without files
      const b = el("button", {type: "button", id: "use-stock"}, `Plan with ${r.stock}`);
      b.onclick = () => { $("model_path").value = r.stock; saveForm(); updateChecklist(); updatePlan(); b.remove(); };
      $("import-notes").append(" ", b);
    }
  } catch (e) { $("import-notes").textContent = e.message; }
}

// -- the machine -------------------------------------------------------------------------------------
async function showSystem() {
  try {
    const s = await api("GET", "/api/system");
    const gpus = s.gpus.map((g) => `${g.name}: ${gib((g.used) / 2 ** 30)} of ${gib(g.total / 2 ** 30)} · ${g.utilization}%`);
    $("fit-gpu").hidden = !s.gpus.length;        // "auto" is the free VRAM of a GPU here: only where there is one
    $("system").textContent = `host RAM ${gib((s.host.total - s.host.available) / 2 ** 30)} used of ${gib(s.host.total / 2 ** 30)}` +
      (gpus.length ? " · GPU " + gpus.join(" · ") : " · no GPU");
  } catch (e) { /* the next poll tries again */ }
}

function modeChanged() {
  // the rank belongs to the adapter: a full fine-tune has none (the TOML then has no [lora])
  $("rank").disabled = $("mode").value !== "lora";
}

async function init() {
  // handlers first: a click while the choices load is not lost
  for (const k of FORM) {
    const changed = () => {
      if (fieldErrors.action.some((p) => p.field === k)) showFieldErrors("action", fieldErrors.action.filter((p) => p.field !== k));
      saveForm(); schedulePlan(); updateChecklist();
    };
    $(k).addEventListener("input", changed);
    $(k).addEventListener("change", changed);
  }
  for (const k of KEPT) { $(k).addEventListener("input", saveKept); $(k).addEventListener("change", saveKept); }
  $("dataset").addEventListener("change", () => { if ($("dataset").value.trim()) loadDataset(false); });
  for (const k of ["target_fps", "max_frames"])          // a clip's trained frames depend on them
    $(k).addEventListener("change", () => { if ($("dataset").value.trim()) loadDataset(false); });
  for (const a of document.querySelectorAll("#nav a")) {
    a.addEventListener("click", (ev) => { ev.preventDefault(); openSection(a.dataset.section); });
  }
  window.addEventListener("popstate", () => applyView(readView()));
  $("resolutions").addEventListener("input", chooseResolutions);
  $("caption-run").onclick = captionImages;
  $("caption-apply").onclick = applyCaptionEdit;
  $("preset").onchange = () => { if ($("preset").value) importToml({preset: $("preset").value}); };
  $("import-toml").onchange = async () => {
    const f = $("import-toml").files[0];
    if (f) await importToml({toml: await f.text()});
    $("import-toml").value = "";
  };
  $("s_run").onchange = sampleRun;
  $("fit-gpu").onclick = () => { $("vram_budget").value = "auto"; saveForm(); updatePlan(); };
  $("enlarge-close").onclick = () => $("enlarge").close();
  $("enlarge").addEventListener("close", () => $("enlarged-video").pause());
  for (const k of ["model_path", "family", "max_text_length", "trigger_word"]) $(k).addEventListener("input", scheduleTokens);
  for (const k of ["model_path", "family"]) $(k).addEventListener("change", scheduleTokens);
  $("enlarge").addEventListener("keydown", viewerKey);
  $("enlarge-step").addEventListener("input", () => { if (viewer) { viewer.si = Number($("enlarge-step").value); showViewer(); } });
  $("load-dataset").onclick = () => loadDataset(true);
  $("upload").onchange = () => upload($("upload").files);
  // images dropped on the dataset's grid are added as "Add images" adds them
  const drop = $("dataset-section");
  drop.addEventListener("dragover", (ev) => { if (ev.dataTransfer.types.includes("Files")) { ev.preventDefault(); drop.classList.add("dropping"); } });
  drop.addEventListener("dragleave", (ev) => { if (ev.target === drop) drop.classList.remove("dropping"); });
  drop.addEventListener("drop", (ev) => {
    drop.classList.remove("dropping");
    if (!ev.dataTransfer.files.length) return;
    ev.preventDefault();
    upload([...ev.dataTransfer.files]);
  });
  $("only-warned").onchange = filterGrid;
  $("start").onclick = startRun;
  $("check").onclick = checkPlan;
  $("stop").onclick = stopRun;
  $("resume").onclick = resumeRun;
  $("sample").onclick = sample;
  $("remove-picked").onclick = removePicked;
  $("mode").addEventListener("change", modeChanged);
  $("model_path").addEventListener("change", () => {
    if (!$("s_model").value) { $("s_model").value = $("model_path").value; saveKept(); sampleFamilyChanged(); }
  });
  $("s_family").addEventListener("change", sampleFamilyChanged);
  $("s_model").addEventListener("change", sampleFamilyChanged);
  const c = await api("GET", "/api/choices");
  for (const k of CHOICES) {
    $(k).replaceChildren(...c[k].map((v) => el("option", {value: v}, v)));
  }
  $("plan_gpu").replaceChildren(...c.plan_gpu.map((g) => el("option", {value: g.value}, g.title)));
  cfgFamilies = c.cfg_families;
  maxUpload = c.max_upload_bytes;
  $("s_family").append(...c.family.map((v) => el("option", {value: v}, v)));
  $("s_dtype").append(...c.dtype.map((v) => el("option", {value: v}, v)));
  $("stock-models").replaceChildren(...c.stock_models.map((v) => el("option", {value: v})));
  stockModels = c.stock_models;
  let kept = {};
  try { kept = JSON.parse(localStorage.getItem(STORE) || "{}"); } catch (e) { kept = {}; }
  for (const [k, v] of Object.entries(c.defaults)) {      // what this browser kept, else the defaults
    if (!$(k)) continue;
    const value = k in kept ? kept[k] : v;
    $(k).value = Array.isArray(value) ? (k === "sample_prompts" ? value.join("\n") : value.join(" ")) : value;
  }
  const presets = await api("GET", "/api/presets");
  $("preset").append(...presets.presets.map((v) => el("option", {value: v}, v)));
  restoreKept();
  status(`runs in ${c.runs_dir} · datasets under ${c.data_roots.join(", ")}`);
  showSystem();
  setInterval(showSystem, 5000);
  modeChanged();
  refreshRuns();
  updateChecklist();
  schedulePlan();
  // the view the address names; a tab opened on the bare address takes this browser's last view
  let view = readView();
  if (!Object.keys(view).length) {
    try { view = JSON.parse(localStorage.getItem(VIEW_STORE) || "{}"); } catch (e) { view = {}; }
    setView(view, false);
  }
  applyView(view);
  if (!view.dataset && $("dataset").value.trim()) loadDataset(false);     // the kept folder's images, shown again
}
init();

/* facegate web page: Compare and Gallery tabs over the HTTP API v1 (docs/dev/http-api.md).
 * Plain browser JavaScript, no dependencies and no build step. Server data is only ever written with
 * textContent / attributes (never innerHTML). Elements the e2e tests use carry data-testid attributes.
 */
"use strict";

(() => {
  // ------------------------------------------------------------------ helpers
  const $ = (sel, root = document) => root.querySelector(sel);
  const tid = (id, root = document) => root.querySelector(`[data-testid="${id}"]`);
  const SUBJECT_PAGE = 20;
  const NAME_RE = /^[A-Za-z0-9_.-]{1,64}$/;
  const SUBJECT_RE = /^[A-Za-z0-9_.@:-]{1,128}$/;
  const VERDICT_TEXT = { match: "Match", no_match: "No match", refused: "Refused" };

  /** An API failure: HTTP status, stable error code, message and detail from the JSON error body. */
  class ApiError extends Error {
    constructor(status, code, message, detail) {
      super(message);
      this.status = status;
      this.code = code;
      this.detail = detail || {};
      this.retryAfter = null;
    }
  }

  const KEY_ITEM = "facegate.apiKey";

  /** Ask for an API key (the server answered 401); kept for this browser tab only. */
  function askForKey(message) {
    const key = window.prompt(`${message}\n\nThis server needs an API key (facegate keys create):`, "");
    if (key && key.trim()) {
      sessionStorage.setItem(KEY_ITEM, key.trim());
      return true;
    }
    return false;
  }

  /** fetch() wrapper: JSON in/out; a non-2xx answer throws ApiError built from {"error": {...}}.
   *  A 401 asks for an API key once and retries with it. */
  async function api(method, path, opts = {}, retried = false) {
    const { form, json } = opts;
    const init = { method, headers: { Accept: "application/json" } };
    const key = sessionStorage.getItem(KEY_ITEM);
    if (key) init.headers.Authorization = `Bearer ${key}`;
    if (json !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(json);
    } else if (form !== undefined) {
      init.body = form;
    }
    let resp;
    try {
      resp = await fetch(path, init);
    } catch (e) {
      throw new ApiError(0, "network_error", `Cannot reach the server (${e.message}).`, {});
    }
    const text = await resp.text();
    let data = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch (_) {
      data = null;
    }
    if (!resp.ok) {
      const e = data && typeof data.error === "object" && data.error ? data.error : null;
      if (resp.status === 401 && !retried) {
        sessionStorage.removeItem(KEY_ITEM);
        if (askForKey(e ? e.message : "Unauthorized")) return api(method, path, opts, true);
      }
      const err = e
        ? new ApiError(resp.status, e.code || `http_${resp.status}`, e.message || resp.statusText, e.detail)
        : new ApiError(resp.status, `http_${resp.status}`, (text || resp.statusText).slice(0, 300), {});
      err.retryAfter = resp.headers.get("Retry-After");
      throw err;
    }
    return data;
  }

  const fmt = (x, digits = 3) => (typeof x === "number" && Number.isFinite(x) ? x.toFixed(digits) : "–");

  /** 0.001 → "0.001 (1 in 1,000)". */
  function fmtFmr(fmr) {
    if (typeof fmr !== "number" || !Number.isFinite(fmr)) return "–";
    if (fmr <= 0) return "0";
    const oneIn = Math.round(1 / fmr).toLocaleString("en-US");
    return `${Number(fmr.toPrecision(3))} (1 in ${oneIn})`;
  }

  const fmtTime = (unixS) => (typeof unixS === "number" ? new Date(unixS * 1000).toLocaleString() : "–");

  function show(el, visible) {
    el.hidden = !visible;
  }

  /** Write an ApiError (or any Error) into an alert box; extra lines (e.g. refused images) below it. */
  function showError(box, err, extra = []) {
    box.replaceChildren();
    const head = document.createElement("p");
    const strong = document.createElement("strong");
    strong.textContent = err instanceof ApiError && err.status ? `Error ${err.status}` : "Error";
    head.append(strong, " ");
    if (err instanceof ApiError && err.code) {
      const code = document.createElement("code");
      code.className = "err-code";
      code.textContent = err.code;
      head.append(code, " ");
    }
    const msg = document.createElement("span");
    msg.className = "err-message";
    msg.textContent = err.message || String(err);
    head.append(msg);
    if (err instanceof ApiError && err.retryAfter) head.append(` Retry in ${err.retryAfter} s.`);
    box.append(head);
    if (extra.length) {
      const ul = document.createElement("ul");
      for (const line of extra) {
        const li = document.createElement("li");
        li.textContent = line;
        ul.append(li);
      }
      box.append(ul);
    }
    box.dataset.code = err instanceof ApiError ? err.code : "client_error";
    show(box, true);
  }

  function clearError(box) {
    box.replaceChildren();
    delete box.dataset.code;
    show(box, false);
  }

  /** Busy state for a submit button: disables it and swaps its label while `fn` runs. */
  async function busy(button, label, fn) {
    const old = button.textContent;
    button.disabled = true;
    button.setAttribute("aria-busy", "true");
    button.textContent = label;
    try {
      return await fn();
    } finally {
      button.textContent = old;
      button.removeAttribute("aria-busy");
      button.disabled = false;
    }
  }

  /** Fill a quality bar (role=meter): width = score, marker = gate, colour = accepted or not. */
  function setQualityBar(bar, quality) {
    const fill = $(".fill", bar);
    const marker = $(".marker", bar);
    if (!quality) {
      fill.style.width = "0%";
      bar.removeAttribute("aria-valuenow");
      return;
    }
    const pct = Math.max(0, Math.min(1, quality.score)) * 100;
    fill.style.width = `${pct}%`;
    marker.style.left = `${Math.max(0, Math.min(1, quality.threshold)) * 100}%`;
    bar.classList.toggle("ok", !!quality.accepted);
    bar.classList.toggle("bad", !quality.accepted);
    bar.setAttribute("aria-valuenow", String(quality.score));
    bar.setAttribute(
      "aria-valuetext",
      `quality ${fmt(quality.score, 2)}, gate ${fmt(quality.threshold, 2)}, ${quality.accepted ? "passes" : "below the gate"}`,
    );
  }

  /** List a face's quality reasons (each a measured value against its limit); empty for a good face. */
  function setReasons(list, quality) {
    const items = (quality?.reasons || []).map((r) => {
      const li = document.createElement("li");
      li.dataset.code = r.code;
      li.textContent = r.message;
      return li;
    });
    list.replaceChildren(...items);
    list.hidden = items.length === 0;
  }

  const qualityText = (q) =>
    q ? `quality ${fmt(q.score, 2)} (gate ${fmt(q.threshold, 2)}) · ${q.accepted ? "passes" : "below gate"}` : "–";

  // ------------------------------------------------------------------ file inputs + drag and drop
  /** Wire a dropzone: dropping files puts them into its <input type=file> and fires "change". */
  function wireDropzone(zone) {
    const input = document.getElementById(zone.dataset.dropFor);
    const nameEl = $(".file-name", zone);
    const updateName = () => {
      const files = Array.from(input.files || []);
      if (nameEl) {
        nameEl.textContent = files.length === 0 ? "" : files.length === 1 ? files[0].name : `${files.length} files`;
      }
    };
    input.addEventListener("change", updateName);
    input.form?.addEventListener("reset", () => setTimeout(updateName));
    zone.addEventListener("dragover", (ev) => {
      ev.preventDefault();
      ev.dataTransfer.dropEffect = "copy";
      zone.classList.add("over");
    });
    zone.addEventListener("dragleave", () => zone.classList.remove("over"));
    zone.addEventListener("drop", (ev) => {
      ev.preventDefault();
      zone.classList.remove("over");
      const files = Array.from(ev.dataTransfer.files || []).filter((f) => f.type.startsWith("image/") || !f.type);
      if (!files.length) return;
      const dt = new DataTransfer();
      for (const f of input.multiple ? files : files.slice(0, 1)) dt.items.add(f);
      input.files = dt.files;
      input.dispatchEvent(new Event("change", { bubbles: true }));
    });
  }

  // ------------------------------------------------------------------ tabs
  function initTabs() {
    const tabs = Array.from(document.querySelectorAll('[role="tab"]'));
    const select = (tab, focus) => {
      for (const t of tabs) {
        const on = t === tab;
        t.setAttribute("aria-selected", String(on));
        t.tabIndex = on ? 0 : -1;
        show(document.getElementById(t.getAttribute("aria-controls")), on);
      }
      if (focus) tab.focus();
      const name = tab.id.replace("tab-", "");
      if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
      if (name === "gallery") Gallery.activate();
    };
    for (const t of tabs) {
      t.addEventListener("click", () => select(t, false));
      t.addEventListener("keydown", (ev) => {
        const i = tabs.indexOf(t);
        const next = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: tabs.length - 1 }[ev.key];
        if (next === undefined) return;
        ev.preventDefault();
        select(tabs[(next + tabs.length) % tabs.length], true);
      });
    }
    const initial = tabs.find((t) => `#${t.id.replace("tab-", "")}` === location.hash) || tabs[0];
    select(initial, false);
  }

  // ------------------------------------------------------------------ readiness
  async function pollStatus() {
    const box = tid("status");
    const text = $(".status-text", box);
    try {
      const r = await api("GET", "/readyz");
      box.dataset.state = "ready";
      text.textContent = `ready · ${r.model} · ${r.device} · ${r.precision}`;
    } catch (e) {
      box.dataset.state = e.status === 503 ? "loading" : "down";
      text.textContent = e.status === 503 ? `not ready: ${e.message}` : `server unreachable (${e.message})`;
      setTimeout(pollStatus, 2000);
    }
  }

  // ------------------------------------------------------------------ Compare
  const Compare = {
    init() {
      this.form = $("#compare-form");
      this.inputs = [$("#compare-img1"), $("#compare-img2")];
      this.previews = [tid("compare-preview-1"), tid("compare-preview-2")];
      this.urls = [null, null];
      this.button = tid("compare-button");
      this.error = tid("compare-error");
      this.result = tid("compare-result");
      this.inputs.forEach((input, i) => input.addEventListener("change", () => this.onFile(i)));
      this.form.addEventListener("submit", (ev) => {
        ev.preventDefault();
        this.submit();
      });
      this.form.addEventListener("reset", () =>
        setTimeout(() => {
          [0, 1].forEach((i) => this.onFile(i));
          show(this.result, false);
          clearError(this.error);
        }),
      );
      $("#compare-swap").addEventListener("click", () => this.swap());
    },

    onFile(i) {
      const file = this.inputs[i].files?.[0];
      if (this.urls[i]) URL.revokeObjectURL(this.urls[i]);
      this.urls[i] = file ? URL.createObjectURL(file) : null;
      const img = this.previews[i];
      if (file) {
        img.src = this.urls[i];
        img.alt = `Preview of ${file.name}`;
      } else {
        img.removeAttribute("src");
        img.alt = "";
      }
      show(img, !!file);
      this.button.disabled = !this.inputs.every((inp) => inp.files && inp.files.length);
    },

    swap() {
      const [a, b] = this.inputs.map((inp) => inp.files?.[0]);
      [b, a].forEach((file, i) => {
        const dt = new DataTransfer();
        if (file) dt.items.add(file);
        this.inputs[i].files = dt.files;
        this.inputs[i].dispatchEvent(new Event("change", { bubbles: true }));
      });
    },

    async submit() {
      const files = this.inputs.map((inp) => inp.files?.[0]);
      if (!files[0] || !files[1]) {
        showError(this.error, new Error("Choose two photos first."));
        return;
      }
      clearError(this.error);
      this.result.setAttribute("aria-busy", "true");
      const form = new FormData();
      form.append("img1", files[0], files[0].name);
      form.append("img2", files[1], files[1].name);
      try {
        const r = await busy(this.button, "Comparing…", () => api("POST", "/api/compare?crops=true", { form }));
        this.render(r);
      } catch (e) {
        show(this.result, false);
        showError(this.error, e);
      } finally {
        this.result.removeAttribute("aria-busy");
        this.button.disabled = !this.inputs.every((inp) => inp.files && inp.files.length);
      }
    },

    render(r) {
      const verdict = tid("compare-verdict", this.result);
      verdict.textContent = VERDICT_TEXT[r.verdict] || r.verdict;
      verdict.dataset.verdict = r.verdict;
      verdict.className = `verdict verdict--${r.verdict}`;
      let reason = r.reason || "";
      if (!r.refused && typeof r.similarity === "number") {
        reason = `similarity ${fmt(r.similarity, 3)} ${r.match ? "≥" : "<"} threshold ${fmt(r.threshold, 3)}`;
      }
      tid("compare-reason", this.result).textContent = reason;
      tid("compare-similarity", this.result).textContent = r.refused ? "not compared" : fmt(r.similarity, 4);
      tid("compare-threshold", this.result).textContent = fmt(r.threshold, 4);
      tid("compare-fmr", this.result).textContent = fmtFmr(r.fmr);
      tid("compare-model", this.result).textContent = r.model || "–";

      const simbar = tid("compare-simbar", this.result);
      if (typeof r.similarity === "number") {
        const pos = (v) => `${((Math.max(-1, Math.min(1, v)) + 1) / 2) * 100}%`;
        $(".fill", simbar).style.width = pos(r.similarity);
        $(".marker", simbar).style.left = pos(r.threshold);
        const track = $(".track", simbar);
        track.classList.toggle("ok", !!r.match);
        track.setAttribute("aria-valuenow", String(r.similarity));
        track.setAttribute("aria-valuetext", `similarity ${fmt(r.similarity, 3)}, threshold ${fmt(r.threshold, 3)}`);
        show(simbar, true);
      } else {
        show(simbar, false);
      }

      (r.faces || []).slice(0, 2).forEach((face, i) => {
        const n = i + 1;
        const crop = tid(`compare-crop-${n}`, this.result);
        if (face.crop) {
          crop.src = face.crop;
          crop.classList.remove("missing");
        } else {
          crop.removeAttribute("src");
          crop.classList.add("missing");
        }
        tid(`compare-quality-${n}`, this.result).textContent = qualityText(face.quality);
        setQualityBar(tid(`compare-qbar-${n}`, this.result), face.quality);
        tid(`compare-face-reason-${n}`, this.result).textContent = face.quality?.reason || "";
        setReasons(tid(`compare-face-reasons-${n}`, this.result), face.quality);
        tid(`compare-face-${n}`, this.result).classList.toggle("refused", face.quality && !face.quality.accepted);
      });
      show(this.result, true);
    },
  };

  // ------------------------------------------------------------------ Gallery
  const Gallery = {
    loaded: false,
    name: "",
    info: null,
    offset: 0,

    init() {
      this.select = tid("gallery-select");
      this.error = tid("gallery-error");
      this.select.addEventListener("change", () => this.choose(this.select.value));
      tid("gallery-refresh").addEventListener("click", () => this.loadGalleries(this.name));
      tid("gallery-delete").addEventListener("click", () => this.deleteGallery());
      $("#gallery-create-form").addEventListener("submit", (ev) => {
        ev.preventDefault();
        this.create();
      });
      $("#enrol-form").addEventListener("submit", (ev) => {
        ev.preventDefault();
        this.enrol();
      });
      $("#search-form").addEventListener("submit", (ev) => {
        ev.preventDefault();
        this.search();
      });
      for (const id of ["enrol-subject", "enrol-files", "search-file"]) {
        tid(id).addEventListener("input", () => this.updateButtons());
        tid(id).addEventListener("change", () => this.updateButtons());
      }
      $("#subjects-prev").addEventListener("click", () => this.loadSubjects(Math.max(0, this.offset - SUBJECT_PAGE)));
      $("#subjects-next").addEventListener("click", () => this.loadSubjects(this.offset + SUBJECT_PAGE));
      this.updateButtons();
    },

    activate() {
      if (this.loaded) return;
      this.loaded = true;
      this.loadGalleries(localStorage.getItem("facegate.gallery") || "");
    },

    updateButtons() {
      const has = !!this.name;
      tid("gallery-delete").disabled = !has;
      tid("enrol-button").disabled = !(has && tid("enrol-subject").value.trim() && tid("enrol-files").files.length);
      tid("search-button").disabled = !(has && tid("search-file").files.length);
    },

    async loadGalleries(preferred) {
      clearError(this.error);
      let list;
      try {
        list = (await api("GET", "/api/galleries")).galleries || [];
      } catch (e) {
        showError(this.error, e);
        return;
      }
      this.select.replaceChildren();
      if (!list.length) {
        this.select.append(new Option("(no gallery yet: create one)", ""));
      }
      for (const g of list) this.select.append(new Option(`${g.name} (${g.subjects})`, g.name));
      this.galleries = new Map(list.map((g) => [g.name, g]));
      const name = this.galleries.has(preferred) ? preferred : list.length ? list[0].name : "";
      this.select.value = name;
      this.choose(name);
    },

    choose(name) {
      this.name = name;
      this.info = this.galleries?.get(name) || null;
      if (name) localStorage.setItem("facegate.gallery", name);
      this.renderInfo();
      this.updateButtons();
      show(tid("enrol-result"), false);
      show(tid("search-result"), false);
      this.loadSubjects(0);
    },

    renderInfo() {
      const g = this.info;
      tid("gallery-info").textContent = g
        ? `model ${g.model} · dim ${g.dim} · ${g.subjects} subject${g.subjects === 1 ? "" : "s"} · created ${fmtTime(g.created_at)}`
        : "Create a gallery to enrol subjects and search.";
    },

    async refreshInfo() {
      try {
        const list = (await api("GET", "/api/galleries")).galleries || [];
        this.galleries = new Map(list.map((g) => [g.name, g]));
        this.info = this.galleries.get(this.name) || null;
        for (const opt of this.select.options) {
          const g = this.galleries.get(opt.value);
          if (g) opt.textContent = `${g.name} (${g.subjects})`;
        }
        this.renderInfo();
      } catch (e) {
        showError(this.error, e);
      }
    },

    async create() {
      const input = tid("gallery-name");
      const name = input.value.trim();
      clearError(this.error);
      if (!NAME_RE.test(name)) {
        showError(this.error, new Error("A gallery name is 1–64 characters of letters, digits, _ . -"));
        input.focus();
        return;
      }
      try {
        await busy(tid("gallery-create"), "Creating…", () => api("POST", "/api/galleries", { json: { name } }));
        input.value = "";
        await this.loadGalleries(name);
      } catch (e) {
        showError(this.error, e);
      }
    },

    async deleteGallery() {
      if (!this.name) return;
      if (!window.confirm(`Delete gallery "${this.name}" with all its subjects? This cannot be undone.`)) return;
      clearError(this.error);
      try {
        await api("DELETE", `/api/galleries/${encodeURIComponent(this.name)}`);
        localStorage.removeItem("facegate.gallery");
        await this.loadGalleries("");
      } catch (e) {
        showError(this.error, e);
      }
    },

    async loadSubjects(offset) {
      const body = $("tbody", tid("subject-list"));
      const err = tid("subjects-error");
      clearError(err);
      body.replaceChildren();
      if (!this.name) {
        tid("subject-total").textContent = "";
        $("#subjects-page").textContent = "";
        $("#subjects-prev").disabled = $("#subjects-next").disabled = true;
        show(tid("subject-empty"), true);
        return;
      }
      let page;
      try {
        const q = `offset=${offset}&limit=${SUBJECT_PAGE}`;
        page = await api("GET", `/api/galleries/${encodeURIComponent(this.name)}/subjects?${q}`);
      } catch (e) {
        showError(err, e);
        return;
      }
      if (offset > 0 && !page.subjects.length && page.total > 0) {
        return this.loadSubjects(Math.max(0, offset - SUBJECT_PAGE));
      }
      this.offset = offset;
      for (const s of page.subjects) body.append(this.subjectRow(s));
      tid("subject-total").textContent = `(${page.total})`;
      const last = Math.min(offset + page.subjects.length, page.total);
      $("#subjects-page").textContent = page.total ? `${offset + 1}–${last} of ${page.total}` : "";
      $("#subjects-prev").disabled = offset === 0;
      $("#subjects-next").disabled = last >= page.total;
      show(tid("subject-empty"), !page.subjects.length);
    },

    subjectRow(s) {
      const tr = document.createElement("tr");
      tr.dataset.testid = "subject-row";
      tr.dataset.subjectId = s.subject_id;
      const meta = s.meta && Object.keys(s.meta).length ? JSON.stringify(s.meta) : "";
      const cells = [s.subject_id, String(s.n_embeddings), fmt(s.template_quality, 2), meta, fmtTime(s.updated_at)];
      cells.forEach((text, i) => {
        const td = document.createElement(i === 0 ? "th" : "td");
        if (i === 0) td.scope = "row";
        td.textContent = text;
        if (i === 3) td.className = "meta";
        tr.append(td);
      });
      const td = document.createElement("td");
      const btn = document.createElement("button");
      btn.type = "button";
      btn.className = "danger small";
      btn.textContent = "Delete";
      btn.dataset.testid = "subject-delete";
      btn.setAttribute("aria-label", `Delete subject ${s.subject_id}`);
      btn.addEventListener("click", () => this.deleteSubject(s.subject_id, btn));
      td.append(btn);
      tr.append(td);
      return tr;
    },

    async deleteSubject(id, btn) {
      if (!window.confirm(`Delete subject "${id}" and its embeddings?`)) return;
      const err = tid("subjects-error");
      clearError(err);
      try {
        await busy(btn, "Deleting…", () =>
          api("DELETE", `/api/galleries/${encodeURIComponent(this.name)}/subjects/${encodeURIComponent(id)}`),
        );
        await Promise.all([this.loadSubjects(this.offset), this.refreshInfo()]);
      } catch (e) {
        showError(err, e);
      }
    },

    async enrol() {
      const err = tid("enrol-error");
      const out = tid("enrol-result");
      const list = tid("enrol-refused");
      clearError(err);
      show(out, false);
      const id = tid("enrol-subject").value.trim();
      const files = Array.from(tid("enrol-files").files || []);
      const metaText = tid("enrol-meta").value.trim();
      if (!SUBJECT_RE.test(id)) {
        showError(err, new Error("A subject id is 1–128 characters of letters, digits, _ . - @ :"));
        tid("enrol-subject").focus();
        return;
      }
      if (!files.length) {
        showError(err, new Error("Choose at least one photo."));
        return;
      }
      if (metaText) {
        let meta;
        try {
          meta = JSON.parse(metaText);
        } catch (e) {
          showError(err, new Error(`Metadata is not valid JSON: ${e.message}`));
          return;
        }
        if (!meta || typeof meta !== "object" || Array.isArray(meta)) {
          showError(err, new Error("Metadata must be a JSON object, e.g. {\"name\": \"Alice\"}."));
          return;
        }
      }
      const form = new FormData();
      for (const f of files) form.append("images", f, f.name);
      if (metaText) form.append("meta", metaText);
      const fileName = (i) => (files[i] ? files[i].name : `image ${i + 1}`);
      const path = `/api/galleries/${encodeURIComponent(this.name)}/subjects/${encodeURIComponent(id)}`;
      try {
        const r = await busy(tid("enrol-button"), "Enrolling…", () => api("POST", path, { form }));
        const s = r.subject;
        tid("enrol-summary").textContent =
          `Enrolled "${s.subject_id}": ${r.accepted} of ${files.length} photo${files.length === 1 ? "" : "s"} ` +
          `accepted; the subject now has ${s.n_embeddings} embedding${s.n_embeddings === 1 ? "" : "s"} ` +
          `(best quality ${fmt(s.template_quality, 2)}).`;
        list.replaceChildren();
        for (const x of r.refused || []) {
          const li = document.createElement("li");
          li.dataset.testid = "enrol-refused-item";
          li.textContent = `${fileName(x.index)}: refused — ${x.reason}`;
          list.append(li);
        }
        out.dataset.accepted = String(r.accepted);
        show(out, true);
        await Promise.all([this.loadSubjects(this.offset), this.refreshInfo()]);
      } catch (e) {
        const refused = (e.detail && Array.isArray(e.detail.refused) ? e.detail.refused : []).map(
          (x) => `${fileName(x.index)}: ${x.reason}`,
        );
        showError(err, e, refused);
      } finally {
        this.updateButtons();
      }
    },

    async search() {
      const err = tid("search-error");
      const out = tid("search-result");
      clearError(err);
      show(out, false);
      const file = tid("search-file").files?.[0];
      const k = Number.parseInt(tid("search-k").value, 10);
      if (!file) {
        showError(err, new Error("Choose a probe photo."));
        return;
      }
      if (!(k >= 1 && k <= 100)) {
        showError(err, new Error("Top k must be between 1 and 100."));
        return;
      }
      const form = new FormData();
      form.append("image", file, file.name);
      try {
        const path = `/api/galleries/${encodeURIComponent(this.name)}/search?k=${k}`;
        const r = await busy(tid("search-button"), "Searching…", () => api("POST", path, { form }));
        this.renderSearch(r);
      } catch (e) {
        showError(err, e);
      } finally {
        this.updateButtons();
      }
    },

    renderSearch(r) {
      const out = tid("search-result");
      const body = $("tbody", tid("search-hits"));
      const summary = tid("search-summary");
      body.replaceChildren();
      out.dataset.refused = String(!!r.refused);
      setQualityBar(tid("search-qbar"), r.face?.quality);
      const q = qualityText(r.face?.quality);
      const op = `threshold ${fmt(r.threshold, 3)}, FMR ${fmtFmr(r.fmr)}`;
      if (r.refused) {
        summary.textContent = `Refused: ${r.reason || "the probe is below the quality gate"} (${q}).`;
      } else if (!r.hits.length) {
        summary.textContent = `No subjects in this gallery (${q}).`;
      } else {
        const best = r.hits[0];
        summary.textContent = best.match
          ? `Best: ${best.subject_id} (${fmt(best.score, 3)}), a match at ${op}. Probe ${q}.`
          : `No match: best ${best.subject_id} (${fmt(best.score, 3)}) is below the ${op}. Probe ${q}.`;
      }
      r.hits.forEach((h, i) => {
        const tr = document.createElement("tr");
        tr.dataset.testid = "search-hit";
        tr.dataset.subjectId = h.subject_id;
        tr.className = h.match ? "hit-match" : "hit-nomatch";
        const cells = [String(i + 1), h.subject_id, fmt(h.score, 4), h.match ? "match" : "no match"];
        cells.forEach((text, j) => {
          const td = document.createElement("td");
          td.textContent = text;
          if (j === 2) td.dataset.testid = "search-hit-score";
          if (j === 3) {
            td.dataset.testid = "search-hit-verdict";
            td.className = h.match ? "verdict-cell ok" : "verdict-cell";
          }
          tr.append(td);
        });
        body.append(tr);
      });
      show(tid("search-hits"), r.hits.length > 0);
      show(out, true);
    },
  };

  // ------------------------------------------------------------------ start
  function start() {
    document.querySelectorAll("[data-drop-for]").forEach(wireDropzone);
    // Dropping a file outside a dropzone must not navigate away from the page.
    window.addEventListener("dragover", (ev) => ev.preventDefault());
    window.addEventListener("drop", (ev) => ev.preventDefault());
    Compare.init();
    Gallery.init();
    initTabs();
    pollStatus();
    document.body.dataset.ready = "true";
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();

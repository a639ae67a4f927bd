// kvserve block-map page: reads /ui/api/config once and the /ui/api/stream events.
// Plain script, no dependencies. The stream is read with fetch() (not EventSource) so the
// API key can travel as an Authorization header.
"use strict";

(() => {
  const KEY_STORAGE = "kvserve-api-key";
  const RECONNECT_MS = 2000;
  const MAX_MAP_HEIGHT = { device: 640, host: 200 };
  const PALETTE = {
    free: [229, 231, 235],
    cachedOld: [191, 219, 254], // head of the eviction queue: evicted next
    cachedNew: [37, 99, 235], // freed most recently: evicted last
    used: [34, 197, 94],
    // Shared blocks, darker with more holders: ref count 2, 3, 4, 5, 6+.
    shared: [[216, 180, 254], [192, 132, 252], [147, 51, 234], [107, 33, 168], [59, 7, 100]],
  };
  const STATE_ORDER = { running: 0, swapped: 1, preempted: 2, waiting: 3 };

  const state = {
    key: sessionStorage.getItem(KEY_STORAGE),
    facts: null,
    snap: null,
    pools: [], // decoded pools: {name, n, refs, lru, numCached, canvas, cell, cols}
    images: {}, // pool name -> the ImageData its canvas is drawn from, reused
    selected: null,
    generation: 0, // bumps on every (re)connect so a stale reader stops
  };

  const $ = (id) => document.getElementById(id);

  // ---------------------------------------------------------------- formatting
  function formatBytes(value) {
    // Same as engine/kv/accounting.py format_bytes: binary units, two decimals.
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = Number(value);
    for (const unit of units) {
      if (Math.abs(v) < 1024 || unit === "TiB") {
        return unit === "B" ? `${Math.round(v).toLocaleString("en-US")} B`
          : `${v.toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 })} ${unit}`;
      }
      v /= 1024;
    }
    return String(value);
  }
  const int = (v) => Number(v).toLocaleString("en-US");
  const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => (
    { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));

  function fillList(dl, rows) {
    dl.innerHTML = rows.map(([k, v, id]) =>
      `<dt>${escapeHtml(k)}</dt><dd${id ? ` id="${id}"` : ""}>${v}</dd>`).join("");
  }

  function setStatus(kind, text) {
    const el = $("status");
    el.dataset.state = kind;
    el.textContent = text;
  }

  // ---------------------------------------------------------------- auth
  function authHeaders() {
    return state.key ? { Authorization: `Bearer ${state.key}` } : {};
  }

  function askForKey(message) {
    const form = $("key-form");
    form.hidden = false;
    $("key-error").textContent = message || "";
    setStatus("error", "API key needed");
    $("key-input").focus();
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.key = $("key-input").value.trim();
    sessionStorage.setItem(KEY_STORAGE, state.key);
    $("key-form").hidden = true;
    start();
  });

  // ---------------------------------------------------------------- totals and planner
  function renderFacts(f) {
    const k = f.kv_shape;
    fillList($("totals"), [
      ["model", escapeHtml(`${f.model} on ${f.device} (${f.dtype})`)],
      ["KV shape", `L=${k.num_layers}, H<sub>kv</sub>=${k.num_kv_heads}, d<sub>head</sub>=${k.head_dim}, ${escapeHtml(k.kv_dtype)} (${k.element_bytes} B/element)`],
      ...(k.groups.length > 1 || k.groups[0].window != null
        ? [["KV groups", describeGroups(k), "total-kv-groups"]] : []),
      ["device blocks", `${int(f.device_blocks)} × ${k.block_size} tokens = ${int(f.token_capacity)} tokens`, "total-device-blocks"],
      ["bytes per token", formatBytes(k.bytes_per_token), "total-bytes-per-token"],
      ["bytes per block", formatBytes(k.bytes_per_block)],
      ["device KV capacity", formatBytes(f.device_kv_bytes)],
      ["host (swap) capacity", `${int(f.host_blocks)} blocks, ${formatBytes(f.host_kv_bytes)}`],
      ["weights", formatBytes(f.weight_bytes)],
      ["activation peak", formatBytes(f.activation_reserve_bytes)],
      ["memory budget", formatBytes(f.memory_budget_bytes)],
      ["max sequences at max_model_len", `${int(f.max_seqs_at_max_len)} (max_model_len ${int(f.max_model_len)})`],
    ]);
    $("plan-scale").textContent = k.scale_bytes ? ` (+ ${k.scale_bytes} B scale per token, head, K/V)` : "";
    $("plan-t").value = Math.min(Number($("plan-t").value), f.max_model_len);
    renderPlan();
  }

  // "5 × sliding_1024 (2 layers), 1 × full (2 layers); a block holds 2 layers"
  function describeGroups(k) {
    const kinds = new Map();
    for (const g of k.groups) {
      const key = `${g.label} (${g.num_layers} layer${g.num_layers === 1 ? "" : "s"})`;
      kinds.set(key, (kinds.get(key) || 0) + 1);
    }
    const parts = [...kinds].map(([key, count]) => `${count} × ${escapeHtml(key)}`);
    return `${parts.join(", ")}; a block holds ${k.page_layers} layer${k.page_layers === 1 ? "" : "s"}`;
  }

  // engine/kv/groups.py's KVGroup.max_blocks: ceil(t / S), or for a window at most
  // ceil((W - 1) / S) + 1.
  function groupBlocks(g, t, blockSize) {
    const full = Math.ceil(t / blockSize);
    return g.window == null ? full : Math.min(full, Math.ceil((g.window - 1) / blockSize) + 1);
  }

  // The arithmetic of engine/kv/accounting.py (bytes_per_token, payload_bytes,
  // blocks_per_sequence, plan_capacity), on the per-token figures the server computed.
  function plan(t, n) {
    const f = state.facts;
    const k = f.kv_shape;
    const layerToken = 2 * k.num_kv_heads * (k.head_dim * k.element_bytes + k.scale_bytes);
    const perToken = k.num_layers * layerToken;
    const blocksPerSeq = k.groups.reduce((sum, g) => sum + groupBlocks(g, t, k.block_size), 0);
    const payloadPerSeq = k.groups.reduce(
      (sum, g) => sum + g.num_layers * layerToken * (g.window == null ? t : Math.min(t, g.window)), 0);
    const blocks = blocksPerSeq * n;
    return {
      bytes_per_token: perToken,
      matches_server: perToken === k.bytes_per_token,
      payload_bytes: payloadPerSeq * n,
      blocks,
      allocated_bytes: blocks * k.bytes_per_block,
      padding_bytes: blocks * k.bytes_per_block - payloadPerSeq * n,
      fits: blocks <= f.device_blocks,
      max_seqs: blocksPerSeq ? Math.floor(f.device_blocks / blocksPerSeq) : 0,
    };
  }

  function renderPlan() {
    if (!state.facts) return;
    const t = Math.max(1, Number($("plan-t").value) || 1);
    const n = Math.max(1, Number($("plan-n").value) || 1);
    const p = plan(t, n);
    const k = state.facts.kv_shape;
    const fit = p.fits ? `<span class="fits">fits</span>` : `<span class="nofit">does not fit</span>`;
    fillList($("plan-out"), [
      ["per token", `2 × ${k.num_layers} × ${k.num_kv_heads} × ${k.head_dim} × ${k.element_bytes} B` +
        (k.scale_bytes ? ` + scales` : "") + ` = ${formatBytes(p.bytes_per_token)}`],
      ["payload", formatBytes(p.payload_bytes), "plan-payload"],
      ["blocks", `${int(p.blocks)} of ${int(state.facts.device_blocks)} — ${fit}`, "plan-blocks"],
      ["allocated (with padding)", formatBytes(p.allocated_bytes), "plan-allocated"],
      ["sequences of this length that fit", int(p.max_seqs), "plan-max-seqs"],
    ]);
  }
  $("plan-t").addEventListener("input", renderPlan);
  $("plan-n").addEventListener("input", renderPlan);

  // ---------------------------------------------------------------- decoding
  // ranges are [first, last, first, last, ...]; last < first for a descending run.
  function forRanges(ranges, fn) {
    let position = 0;
    for (let i = 0; i < ranges.length; i += 2) {
      const first = ranges[i], last = ranges[i + 1];
      const step = last >= first ? 1 : -1;
      for (let id = first; ; id += step) {
        fn(id, position++);
        if (id === last) break;
      }
    }
  }

  function decodePool(pool, requests) {
    const n = pool.num_blocks;
    const refs = new Uint16Array(n);
    const lru = new Int32Array(n).fill(-1);
    let numCached = 0;
    forRanges(pool.cached_lru, (id) => { lru[id] = numCached++; });
    for (const r of requests) {
      if (r.pool === pool.name) forRanges(r.ranges, (id) => { refs[id]++; });
    }
    return { name: pool.name, n, refs, lru, numCached };
  }

  function blockState(pool, id) {
    const ref = pool.refs[id];
    if (ref > 1) return "shared";
    if (ref === 1) return "used";
    return pool.lru[id] >= 0 ? "cached" : "free";
  }

  function colourOf(pool, id) {
    const ref = pool.refs[id];
    if (ref > 1) return PALETTE.shared[Math.min(ref - 2, PALETTE.shared.length - 1)];
    if (ref === 1) return PALETTE.used;
    const rank = pool.lru[id];
    if (rank < 0) return PALETTE.free;
    const f = pool.numCached > 1 ? rank / (pool.numCached - 1) : 1;
    return PALETTE.cachedOld.map((c, i) => Math.round(c + (PALETTE.cachedNew[i] - c) * f));
  }

  // ---------------------------------------------------------------- block map
  function ensureCanvases(pools) {
    const box = $("pools");
    const names = pools.map((p) => p.name).join(",");
    if (box.dataset.pools === names) return;
    box.dataset.pools = names;
    box.innerHTML = "";
    for (const p of pools) {
      const title = document.createElement("div");
      title.className = "pool-title";
      title.id = `title-${p.name}`;
      box.appendChild(title);
      const canvas = document.createElement("canvas");
      canvas.className = "blockmap";
      canvas.id = `map-${p.name}`;
      canvas.dataset.pool = p.name;
      canvas.addEventListener("mousemove", onHover);
      canvas.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
      box.appendChild(canvas);
    }
  }

  function selectedBlocks(poolName) {
    const ids = new Set();
    if (!state.selected || !state.snap) return null;
    const r = state.snap.requests.find((x) => x.id === state.selected);
    if (!r) return null;
    if (r.pool === poolName) forRanges(r.ranges, (id) => ids.add(id));
    return ids;
  }

  function drawPool(pool) {
    const canvas = $(`map-${pool.name}`);
    const title = $(`title-${pool.name}`);
    if (!pool.n) {
      canvas.hidden = true;
      title.textContent = `${pool.name} pool: no blocks`;
      return;
    }
    canvas.hidden = false;
    const width = Math.max(200, canvas.parentElement.clientWidth);
    const maxHeight = MAX_MAP_HEIGHT[pool.name] || 200;
    const cell = Math.max(1, Math.min(16, Math.floor(Math.sqrt((width * maxHeight) / pool.n))));
    const cols = Math.max(1, Math.floor(width / cell));
    const rows = Math.ceil(pool.n / cols);
    // Resizing a canvas reallocates and clears it: only when the geometry changes. The
    // pixel buffer is reused across snapshots too (two a second, megabytes each).
    if (canvas.width !== cols * cell || canvas.height !== rows * cell) {
      canvas.width = cols * cell;
      canvas.height = rows * cell;
      canvas.style.width = `${cols * cell}px`;
      canvas.style.height = `${rows * cell}px`;
    }
    Object.assign(pool, { canvas, cell, cols });
    const ctx = canvas.getContext("2d");
    let image = state.images[pool.name];
    if (!image || image.width !== canvas.width || image.height !== canvas.height) {
      image = state.images[pool.name] = ctx.createImageData(canvas.width, canvas.height);
    }
    const px = new Uint32Array(image.data.buffer);
    const gap = cell >= 5 ? 1 : 0;
    const highlight = selectedBlocks(pool.name);
    const counts = { free: 0, cached: 0, used: 0, shared: 0 };
    for (let id = 0; id < pool.n; id++) {
      counts[blockState(pool, id)]++;
      let [r, g, b] = colourOf(pool, id);
      if (highlight && !highlight.has(id)) { // fade everything but the selected request
        r = Math.round(r + (255 - r) * 0.75); g = Math.round(g + (255 - g) * 0.75); b = Math.round(b + (255 - b) * 0.75);
      }
      const value = (255 << 24) | (b << 16) | (g << 8) | r; // RGBA bytes, little-endian
      const x0 = (id % cols) * cell, y0 = Math.floor(id / cols) * cell;
      for (let y = y0; y < y0 + cell - gap; y++) {
        px.fill(value, y * canvas.width + x0, y * canvas.width + x0 + cell - gap);
      }
    }
    ctx.putImageData(image, 0, 0);
    Object.assign(canvas.dataset, counts);
    title.textContent = `${pool.name} pool: ${int(pool.n)} blocks — used ${int(counts.used)}, ` +
      `shared ${int(counts.shared)}, cached ${int(counts.cached)}, free ${int(counts.free)}`;
  }

  function renderLegend() {
    const swatch = (c) => `rgb(${c.join(",")})`;
    const items = [
      ["free", PALETTE.free], ["cached (evicted next)", PALETTE.cachedOld],
      ["cached (freed last)", PALETTE.cachedNew], ["used", PALETTE.used],
      ...PALETTE.shared.map((c, i) => [`shared ×${i + 2}${i === PALETTE.shared.length - 1 ? "+" : ""}`, c]),
    ];
    $("legend").innerHTML = items.map(([name, c]) =>
      `<span><i style="background:${swatch(c)}"></i>${escapeHtml(name)}</span>`).join("");
  }

  function cellAt(canvas, clientX, clientY) {
    const pool = state.pools.find((p) => p.name === canvas.dataset.pool);
    if (!pool || !pool.cell) return null;
    const rect = canvas.getBoundingClientRect();
    const x = (clientX - rect.left) * (canvas.width / rect.width);
    const y = (clientY - rect.top) * (canvas.height / rect.height);
    const id = Math.floor(y / pool.cell) * pool.cols + Math.floor(x / pool.cell);
    return id >= 0 && id < pool.n ? { pool, id } : null;
  }

  // Centre of a block's cell relative to its canvas's top-left corner (CSS pixels).
  function cellCenter(poolName, id) {
    const pool = state.pools.find((p) => p.name === poolName);
    const rect = pool.canvas.getBoundingClientRect();
    const scale = rect.width / pool.canvas.width;
    return {
      x: ((id % pool.cols) + 0.5) * pool.cell * scale,
      y: (Math.floor(id / pool.cols) + 0.5) * pool.cell * scale,
    };
  }

  function describe(poolName, id) {
    const pool = state.pools.find((p) => p.name === poolName);
    const kind = blockState(pool, id);
    const head = `${poolName} block ${id} · ${kind}`;
    if (kind === "free") return head;
    if (kind === "cached") {
      return `${head} prefix, evicted ${ordinal(pool.lru[id] + 1)} of ${int(pool.numCached)} cached (LRU)`;
    }
    const blockSize = state.snap.block_size;
    const lines = [pool.refs[id] > 1 ? `${head} by ${pool.refs[id]} holders` : head];
    for (const r of state.snap.requests) {
      if (r.pool !== poolName) continue;
      forRanges(r.ranges, (bid, position) => {
        if (bid !== id) return;
        const first = position * blockSize;
        const last = Math.max(first, Math.min(first + blockSize, r.kv_tokens) - 1);
        lines.push(`${r.id} (${r.state}) tokens ${first}–${last}`);
      });
    }
    return lines.join("\n");
  }

  function ordinal(n) {
    const s = ["th", "st", "nd", "rd"], v = n % 100;
    return n + (s[(v - 20) % 10] || s[v] || s[0]);
  }

  function onHover(event) {
    const hit = cellAt(event.currentTarget, event.clientX, event.clientY);
    const tip = $("tooltip");
    if (!hit) { tip.hidden = true; return; }
    tip.textContent = describe(hit.pool.name, hit.id);
    tip.style.left = `${event.clientX + 14}px`;
    tip.style.top = `${event.clientY + 14}px`;
    tip.hidden = false;
  }

  // ---------------------------------------------------------------- requests and counts
  function renderCounts(snap) {
    const t = snap.totals;
    const set = (id, v) => { $(id).textContent = v; };
    set("count-running", t.running);
    set("count-waiting", t.waiting);
    set("count-swapped", t.swapped);
    set("count-used", int(t.device.used));
    set("count-cached", int(t.device.cached));
    set("count-free", int(t.device.free));
    set("count-payload", formatBytes(t.payload_bytes));
    set("count-allocated", formatBytes(t.allocated_bytes));
    set("count-shared", formatBytes(t.shared_bytes));
    const groups = t.groups || [];
    $("count-groups").hidden = !groups.length;
    $("count-groups").innerHTML = groups.map((g, i) =>
      `<span>group ${i} ${escapeHtml(g.label)}: <b>${int(g.used)}</b> used, ${int(g.cached)} cached, ` +
      `${formatBytes(g.payload_bytes)} / ${formatBytes(g.allocated_bytes)}</span>`).join("");
    set("count-seq", snap.seq);
    set("count-capture", `${snap.capture_ms.toFixed(2)} ms`);
  }

  // Blocks per KV group ("by group: 3 + 3 + 40"), for a hybrid model's rows.
  function groupSplit(r) {
    return r.group_blocks && r.group_blocks.length > 1 ? `by group: ${r.group_blocks.join(" + ")}` : "";
  }

  function renderRequests(snap) {
    const rows = [...snap.requests].sort((a, b) =>
      (STATE_ORDER[a.state] - STATE_ORDER[b.state]) || a.id.localeCompare(b.id));
    const byState = { running: 0, waiting: 0, swapped: 0, preempted: 0 };
    const html = rows.map((r) => {
      byState[r.state]++;
      const sel = r.id === state.selected ? ' class="selected"' : "";
      const where = r.pool === "host" ? " (host)" : "";
      return `<tr data-id="${escapeHtml(r.id)}" data-state="${r.state}"${sel}>` +
        `<td>${escapeHtml(r.id)}</td><td class="state-${r.state}">${r.state}</td>` +
        `<td>${r.priority}</td><td>${int(r.prompt_tokens)}</td><td>${int(r.generated_tokens)}</td>` +
        `<td title="${escapeHtml(groupSplit(r))}">${int(r.blocks)}${where}</td>` +
        `<td>${formatBytes(r.payload_bytes)} / ${formatBytes(r.allocated_bytes)}</td>` +
        `<td>${int(r.prefix_hit_tokens)}</td><td>${r.time_in_state_s.toFixed(1)} s</td></tr>`;
    }).join("");
    const body = $("requests").tBodies[0];
    body.innerHTML = html;
    Object.assign($("requests").dataset, byState, { seq: snap.seq });
  }

  $("requests").addEventListener("click", (event) => {
    const row = event.target.closest("tr[data-id]");
    if (!row) return;
    state.selected = state.selected === row.dataset.id ? null : row.dataset.id;
    if (state.snap) render(state.snap);
  });

  function render(snap) {
    state.snap = snap;
    state.pools = snap.pools.map((p) => decodePool(p, snap.requests));
    ensureCanvases(state.pools);
    state.pools.forEach(drawPool);
    renderCounts(snap);
    renderRequests(snap);
    document.body.dataset.seq = snap.seq;
  }

  // ---------------------------------------------------------------- transport
  function handleEvent(raw) {
    let name = "message";
    const data = [];
    for (const line of raw.split("\n")) {
      if (line.startsWith("event:")) name = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
    }
    if (!data.length) return;
    const payload = JSON.parse(data.join("\n"));
    if (name === "snapshot") {
      render(payload);
      setStatus("live", `live · ${new Date().toLocaleTimeString()}`);
    } else if (name === "engine" && !payload.alive) {
      setStatus("error", `engine down: ${payload.reason}`);
    }
  }

  async function readStream(generation) {
    const response = await fetch("/ui/api/stream", { headers: authHeaders(), cache: "no-store" });
    if (response.status === 401) { askForKey("the key was not accepted"); return false; }
    if (!response.ok) throw new Error(`stream: HTTP ${response.status}`);
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    while (generation === state.generation) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        handleEvent(buffer.slice(0, cut));
        buffer = buffer.slice(cut + 2);
      }
    }
    reader.cancel().catch(() => {});
    return true;
  }

  async function loadFacts() {
    const response = await fetch("/ui/api/config", { headers: authHeaders(), cache: "no-store" });
    if (response.status === 401) { askForKey(state.key ? "the key was not accepted" : ""); return false; }
    if (!response.ok) throw new Error(`config: HTTP ${response.status}`);
    state.facts = await response.json();
    renderFacts(state.facts);
    return true;
  }

  async function start() {
    const generation = ++state.generation;
    try {
      if (!(await loadFacts())) return;
      setStatus("connecting", "connecting…");
      if (!(await readStream(generation))) return;
      setStatus("error", "stream ended; reconnecting");
    } catch (error) {
      setStatus("error", `${error.message}; reconnecting`);
    }
    if (generation === state.generation) setTimeout(() => { if (generation === state.generation) start(); }, RECONNECT_MS);
  }

  window.kvui = { state, plan, palette: PALETTE, describe, cellCenter, formatBytes };
  renderLegend();
  start();
})();

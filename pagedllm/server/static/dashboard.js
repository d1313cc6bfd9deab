// The KV cache page: one cell per block, coloured by state, with the engine's figures and
// small plots. Live (server-sent events from the server) or a static report (data in the page).
"use strict";

const PAGE = JSON.parse(document.getElementById("page-data").textContent);
const STATES = PAGE.states;  // names, indexed by the block map's state codes
const CSS = getComputedStyle(document.documentElement);
const COLORS = STATES.map((name) => CSS.getPropertyValue("--" + name).trim());
const HISTORY_S = 300;  // live plots keep the last five minutes, in this tab only
const KEY_STORE = "pagedllm-api-key";

const $ = (root, selector) => root.querySelector(selector);
const pct = (x) => (100 * x).toFixed(1) + "%";
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function decode(b64) {
  const text = atob(b64);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  return bytes;
}

function decodeBlocks(blocks) {
  return {blockSize: blocks.block_size, states: decode(blocks.states),
          refs: decode(blocks.ref_counts), filled: decode(blocks.filled), owners: blocks.owners,
          freed: blocks.freed || {}};
}

function ownersOf(map, block) {
  const names = [];
  for (const [request, runs] of Object.entries(map.owners)) {
    if (runs.some(([start, length]) => block >= start && block < start + length)) {
      // A request whose sliding window has let go of older blocks says how many.
      const freed = map.freed[request];
      names.push(freed ? `${request} (${freed} older blocks freed by its window)` : request);
    }
  }
  return names;
}

// A lighter shade of each state's colour, for the empty slots of a block (its internal waste).
const PALE = COLORS.map((hex) => {
  const n = parseInt(hex.slice(1), 16);
  const mix = (c) => Math.round(c + (255 - c) * 0.68);
  return `rgb(${mix(n >> 16)}, ${mix((n >> 8) & 255)}, ${mix(n & 255)})`;
});

class BlockGrid {
  constructor(canvas, tooltip) {
    this.canvas = canvas;
    this.tooltip = tooltip;
    this.map = null;
    this.pointer = null;  // the last mouse position over the grid, to refresh the tooltip
    canvas.addEventListener("mousemove", (event) => this.hover(event));
    canvas.addEventListener("mouseleave", () => {
      this.pointer = null;
      tooltip.hidden = true;
    });
  }

  layout(numBlocks) {
    const width = Math.min(this.canvas.parentElement.clientWidth || 640, 640);
    const cell = Math.max(3, Math.min(18, Math.floor(Math.sqrt((width * 360) / numBlocks))));
    const cols = Math.max(1, Math.floor(width / cell));
    return {cell, cols, rows: Math.ceil(numBlocks / cols), gap: cell >= 6 ? 1 : 0};
  }

  draw(map) {
    this.map = map;
    const n = map.states.length;
    const {cell, cols, rows, gap} = (this.geometry = this.layout(n));
    const ratio = window.devicePixelRatio || 1;
    const canvas = this.canvas;
    canvas.style.width = cols * cell + "px";
    canvas.style.height = rows * cell + "px";
    canvas.width = cols * cell * ratio;
    canvas.height = rows * cell * ratio;
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    const size = cell - gap;
    for (let i = 0; i < n; i++) {
      const x = (i % cols) * cell, y = Math.floor(i / cols) * cell;
      const state = map.states[i];
      const full = Math.round((size * map.filled[i]) / map.blockSize);
      ctx.fillStyle = state === 0 ? COLORS[0] : PALE[state];
      ctx.fillRect(x, y, size, size - full);
      ctx.fillStyle = COLORS[state];
      ctx.fillRect(x, y + size - full, size, full);
    }
    if (this.pointer) this.hover(this.pointer);
  }

  hover(event) {
    this.pointer = {clientX: event.clientX, clientY: event.clientY};
    if (!this.map) return;
    const {cell, cols} = this.geometry;
    const box = this.canvas.getBoundingClientRect();
    const col = Math.floor((event.clientX - box.left) / cell);
    const block = Math.floor((event.clientY - box.top) / cell) * cols + col;
    if (col >= cols || block < 0 || block >= this.map.states.length) {
      this.tooltip.hidden = true;
      return;
    }
    const owners = ownersOf(this.map, block);
    this.tooltip.textContent =
      `block ${block}: ${STATES[this.map.states[block]]}, ref count ${this.map.refs[block]}, ` +
      `${this.map.filled[block]}/${this.map.blockSize} tokens\n` +
      (owners.length ? `owners (${owners.length}): ` + owners.slice(0, 3).join(", ") +
        (owners.length > 3 ? ` and ${owners.length - 3} more` : "") : "no owner");
    this.tooltip.style.left = event.clientX + 14 + "px";
    this.tooltip.style.top = event.clientY + 14 + "px";
    this.tooltip.hidden = false;
  }
}

// A small line plot: series of [x, y] points over [xMin, xMax], y from 0 to the largest value.
class Plot {
  constructor(parent, title, series) {
    const figure = document.createElement("figure");
    figure.className = "plot";
    figure.innerHTML = "<figcaption><span></span><span></span></figcaption><canvas></canvas>";
    figure.style.margin = "0";
    $(figure, "span").textContent = title;
    parent.appendChild(figure);
    this.label = figure.querySelectorAll("span")[1];
    this.canvas = $(figure, "canvas");
    this.series = series;  // [{color, format}]
  }

  draw(lines, xMin, xMax, cursorX, yMaxAtLeast = 0) {
    const canvas = this.canvas, ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    canvas.width = width * ratio;
    canvas.height = height * ratio;
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    let yMax = yMaxAtLeast;
    for (const line of lines) for (const [, y] of line) yMax = Math.max(yMax, y);
    yMax = yMax || 1;
    const sx = (x) => ((x - xMin) / Math.max(xMax - xMin, 1e-9)) * (width - 2) + 1;
    const sy = (y) => height - 2 - (y / yMax) * (height - 12);
    lines.forEach((line, k) => {
      ctx.strokeStyle = this.series[k].color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      line.forEach(([x, y], i) => (i ? ctx.lineTo(sx(x), sy(y)) : ctx.moveTo(sx(x), sy(y))));
      ctx.stroke();
    });
    ctx.fillStyle = "#667085";
    ctx.font = "10px sans-serif";
    ctx.fillText("max " + this.series[0].format(yMax), 3, 10);
    if (cursorX !== null) {
      ctx.strokeStyle = "#1d2330";
      ctx.beginPath();
      ctx.moveTo(sx(cursorX), 0);
      ctx.lineTo(sx(cursorX), height);
      ctx.stroke();
    }
    // The values at the cursor, or the latest ones.
    const valueAt = (line) => {
      let value = null;
      for (const [x, y] of line) if (cursorX === null || x <= cursorX) value = y;
      return value;
    };
    this.label.textContent = lines.map((line, k) => {
      const value = valueAt(line);
      return value === null ? "-" : this.series[k].format(value);
    }).join(" / ");
  }
}

class Panel {
  constructor(name, summary) {
    const node = document.getElementById("panel-template").content.firstElementChild.cloneNode(true);
    node.dataset.layout = name;
    $(node, "[data-role=name]").textContent = name;
    $(node, "[data-role=summary]").textContent = summary || "";
    document.getElementById("panels").appendChild(node);
    this.node = node;
    this.grid = new BlockGrid($(node, "[data-role=grid]"), document.getElementById("tooltip"));
    this.counts = STATES.map((state, code) => {
      const item = document.createElement("li");
      item.dataset.state = state;
      item.title = PAGE.state_descriptions[code];
      item.innerHTML = '<span class="swatch"></span><span class="name"></span><span class="count">0</span>';
      $(item, ".swatch").style.background = COLORS[code];
      $(item, ".name").textContent = state;
      $(node, "[data-role=legend]").appendChild(item);
      return $(item, ".count");
    });
  }

  show(stats, map, tokensPerS) {
    this.grid.draw(map);
    const counts = new Array(STATES.length).fill(0);
    for (const state of map.states) counts[state]++;
    counts.forEach((count, code) => { this.counts[code].textContent = count; });
    const figures = {
      num_blocks: stats.num_blocks, usage: pct(stats.usage), waste: stats.waste_pct.toFixed(1) + "%",
      running: stats.num_running, waiting: stats.num_waiting, preemptions: stats.num_preemptions,
      prefix_hit_rate: pct(stats.prefix_cache_hit_rate),
      tokens_per_s: tokensPerS === null ? "-" : tokensPerS.toFixed(1),
    };
    for (const [name, value] of Object.entries(figures)) {
      $(this.node, `[data-figure=${name}]`).textContent = value;
    }
  }
}

function setStatus(text, kind = "") {
  const status = document.getElementById("status");
  status.textContent = text;
  status.className = "status " + kind;
}

// -- live: the server's events, read with fetch() so the API key travels in a header ----------

function liveKey() {
  const fromFragment = new URLSearchParams(location.hash.slice(1)).get("key");
  if (fromFragment) {  // a link with #key=...: keep it for this tab, out of the address bar
    sessionStorage.setItem(KEY_STORE, fromFragment);
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem(KEY_STORE);
}

async function readEvents(response, onMessage) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trim()).join("\n");
      buffer = buffer.slice(end + 2);
      if (data) onMessage(JSON.parse(data));
    }
  }
}

function startLive() {
  const panel = new Panel("KV cache blocks", "");
  const samples = [];
  const plots = $(panel.node, "[data-role=plots]");
  const percent = (x) => x.toFixed(1) + "%", count = (x) => String(Math.round(x));
  const charts = {
    usage: new Plot(plots, "KV usage %", [{color: COLORS[1], format: percent}]),
    waste: new Plot(plots, "waste %", [{color: COLORS[4], format: percent}]),
    queues: new Plot(plots, "running / waiting", [{color: COLORS[1], format: count},
                                                  {color: COLORS[4], format: count}]),
    tokens: new Plot(plots, "generated tokens/s", [{color: COLORS[3], format: (x) => x.toFixed(1)}]),
  };

  let serverError = false;  // the server said why it stopped sending: wait before asking again

  function onMessage(message) {
    serverError = Boolean(message.error);
    if (serverError) {
      setStatus(message.error, "error");
      return;
    }
    const stats = message.stats, now = message.time_s;
    while (samples.length && samples[0].t < now - HISTORY_S) samples.shift();
    // tokens/s over the last two seconds or so
    const before = samples.find((h) => h.t >= now - 2.5);
    const tokensPerS = before && now > before.t
      ? (stats.num_generation_tokens - before.generated) / (now - before.t) : null;
    samples.push({t: now, generated: stats.num_generation_tokens, usage: 100 * stats.usage,
                  waste: stats.waste_pct, running: stats.num_running, waiting: stats.num_waiting,
                  tokensPerS: tokensPerS || 0});
    panel.show(stats, decodeBlocks(message.blocks), tokensPerS);
    $(panel.node, "[data-role=summary]").textContent =
      `${stats.num_blocks} blocks of ${stats.block_size} tokens, ` +
      `${(stats.kv_cache_bytes / 2 ** 20).toFixed(1)} MiB; hover a block to see its owners`;
    const series = (field) => samples.map((h) => [h.t, h[field]]);
    const xMin = Math.max(now - HISTORY_S, samples[0].t);
    charts.usage.draw([series("usage")], xMin, now, null, 100);
    charts.waste.draw([series("waste")], xMin, now, null, 100);
    charts.queues.draw([series("running"), series("waiting")], xMin, now, null, 1);
    charts.tokens.draw([series("tokensPerS")], xMin, now, null, 1);
  }

  async function connect() {
    document.getElementById("key-form").hidden = true;
    for (;;) {
      const key = liveKey();
      let response;
      try {
        response = await fetch(PAGE.events, {cache: "no-store",
                                             headers: key ? {Authorization: "Bearer " + key} : {}});
      } catch (error) {
        setStatus("server unreachable; retrying", "error");
        await sleep(2000);
        continue;
      }
      if (response.status === 401) {
        sessionStorage.removeItem(KEY_STORE);
        setStatus(key ? "wrong API key" : "API key needed", "error");
        document.getElementById("key-form").hidden = false;
        return;
      }
      if (!response.ok) {
        setStatus(`the server answered ${response.status}; retrying`, "error");
        await sleep(2000);
        continue;
      }
      setStatus("live", "live");
      try {
        await readEvents(response, onMessage);  // ends every few seconds; reconnect at once
        if (serverError) await sleep(2000);
      } catch (error) {
        setStatus("connection lost; retrying", "error");
        await sleep(1000);
      }
    }
  }

  document.getElementById("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, document.getElementById("key-input").value);
    connect();
  });
  connect();
}

// -- report: recorded frames of several layouts, side by side on one time cursor ---------------

function startReport() {
  setStatus(PAGE.subtitle || "");
  const unit = PAGE.time_unit;
  const panels = PAGE.panels.map((data) => {
    const panel = new Panel(data.name, data.summary);
    const plots = $(panel.node, "[data-role=plots]");
    const count = (x) => String(Math.round(x));
    panel.slots = new Plot(plots, "allocated / used KV slots", [{color: COLORS[1], format: count},
                                                               {color: COLORS[3], format: count}]);
    panel.queue = new Plot(plots, "running / waiting", [{color: COLORS[1], format: count},
                                                        {color: COLORS[4], format: count}]);
    panel.data = data;
    return panel;
  });
  const tEnd = Math.max(...PAGE.panels.map((p) => p.timeline[p.timeline.length - 1][0]));
  const cursor = document.getElementById("cursor");
  document.getElementById("controls").hidden = false;

  function render() {
    const t = (cursor.value / cursor.max) * tEnd;
    document.getElementById("cursor-label").textContent =
      unit === "step" ? `step ${Math.round(t)}` : `${t.toFixed(2)} s`;
    for (const panel of panels) {
      const {frames, timeline} = panel.data;
      let frame = frames[0];
      for (const f of frames) if (f.t <= t) frame = f;
      panel.show(frame.stats, decodeBlocks(frame.blocks), null);
      const column = (k) => timeline.map((row) => [row[0], row[k]]);
      panel.slots.draw([column(1), column(2)], 0, tEnd, t, panel.data.token_slots);
      panel.queue.draw([column(3), column(4)], 0, tEnd, t, 1);
    }
  }

  let playing = null;
  document.getElementById("play").addEventListener("click", (event) => {
    if (playing) {
      clearInterval(playing);
      playing = null;
      event.target.textContent = "Play";
      return;
    }
    event.target.textContent = "Pause";
    if (+cursor.value >= +cursor.max) cursor.value = 0;
    playing = setInterval(() => {
      cursor.value = Math.min(+cursor.max, +cursor.value + 4);
      render();
      if (+cursor.value >= +cursor.max) event.target.click();
    }, 50);
  });
  cursor.addEventListener("input", render);
  render();
}

if (PAGE.mode === "report") startReport(); else startLive();

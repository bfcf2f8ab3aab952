"use strict";
// memplan's HTML report: everything below is drawn from the JSON block #memplan-data, the
// object the command prints with --json; no number is typed into the page any other way.
(function () {
  var GIB = 1073741824n, MIB = 1048576n;
  // the SVG namespace, read off an <svg> element the HTML parser made (no URL in the page)
  var NS = document.getElementById("svg-namespace").namespaceURI;
  var errors = [];

  function fail(what) {
    errors.push(String(what));
    var box = document.getElementById("errors");
    if (box) { box.hidden = false; box.textContent = errors.join("\n"); }
    document.body.setAttribute("data-errors", String(errors.length));
  }
  window.addEventListener("error", function (e) { fail("script error: " + e.message); });
  document.addEventListener("securitypolicyviolation", function (e) {
    fail("blocked request: " + e.blockedURI + " (" + e.violatedDirective + ")");
  });

  // Bytes / unit with two decimals, rounded half to even on the exact integer quotient: the
  // digits Python's f"{num_bytes / unit:.2f}" prints for the same bytes.
  function fixed2(bytes, unit) {
    var b = BigInt(Math.round(bytes)), neg = b < 0n;
    if (neg) b = -b;
    var scaled = b * 100n, q = scaled / unit, r = scaled % unit;
    if (2n * r > unit || (2n * r === unit && q % 2n === 1n)) q += 1n;
    var s = q.toString().padStart(3, "0");
    return (neg && q !== 0n ? "-" : "") + s.slice(0, -2) + "." + s.slice(-2);
  }
  function gib(b) { return fixed2(b, GIB) + " GiB"; }
  function size(b) { return (Math.abs(b) < 1073741824 ? fixed2(b, MIB) + " MiB" : gib(b)); }
  function num(x, digits) { return x === null || x === undefined ? "n/a" : Number(x).toFixed(digits); }
  function pct(x) { return x === null || x === undefined ? "n/a" : (100 * x).toFixed(1) + "%"; }

  function el(tag, attrs) {
    var node = document.createElement(tag);
    setAll(node, attrs);
    for (var i = 2; i < arguments.length; i++) add(node, arguments[i]);
    return node;
  }
  function sv(tag, attrs) {
    var node = document.createElementNS(NS, tag);
    setAll(node, attrs);
    for (var i = 2; i < arguments.length; i++) add(node, arguments[i]);
    return node;
  }
  function setAll(node, attrs) {
    for (var k in attrs || {}) if (attrs[k] !== null && attrs[k] !== undefined) node.setAttribute(k, attrs[k]);
  }
  function add(node, kid) {
    if (kid === null || kid === undefined) return;
    if (Array.isArray(kid)) { kid.forEach(function (k) { add(node, k); }); return; }
    node.appendChild(typeof kid === "object" ? kid : document.createTextNode(String(kid)));
  }
  // a byte count as text, its exact bytes in the tooltip and a data attribute
  function bytesCell(b, kind) {
    return el("span", {"class": "bytes", "data-bytes": String(b), title: Number(b).toLocaleString("en-US") + " bytes"},
              kind === "gib" ? gib(b) : size(b));
  }
  function exactBytes(b) {
    return el("span", {"class": "bytes", "data-bytes": String(b)}, (b > 0 ? "+" : "") + Number(b).toLocaleString("en-US") + " B");
  }
  function section(id, title, intro) {
    var s = el("section", {id: id}, el("h2", null, title));
    if (intro) s.appendChild(el("p", {"class": "intro"}, intro));
    document.getElementById("report").appendChild(s);
    return s;
  }
  function table(id, headers, rows) {
    return el("table", {id: id},
      el("thead", null, el("tr", null, headers.map(function (h) { return el("th", null, h); }))),
      el("tbody", null, rows.map(function (row) {
        return el("tr", null, row.map(function (c) { return el("td", null, c); }));
      })));
  }
  // any value: bytes fields as sizes, objects as nested lists
  function value(key, v) {
    if (v === null || v === undefined) return "n/a";
    if (typeof v === "number" && /_bytes$/.test(key)) return bytesCell(v);
    if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toPrecision(4);
    if (typeof v === "object") return keyValues(v);
    return String(v);
  }
  function keyValues(obj) {
    if (obj === null || typeof obj !== "object") return el("p", null, obj === null ? "n/a" : String(obj));
    if (Array.isArray(obj)) return el("ul", null, obj.map(function (v, i) { return el("li", null, value(String(i), v)); }));
    return el("dl", {"class": "kv"}, Object.keys(obj).map(function (k) {
      return [el("dt", null, k.replace(/_bytes$/, "").replace(/_/g, " ")), el("dd", null, value(k, obj[k]))];
    }));
  }
  function cards(items) {
    return el("div", {"class": "cards"}, items.map(function (it) {
      return el("div", {"class": "card" + (it[2] ? " " + it[2] : "")}, el("div", {"class": "label"}, it[0]), el("div", {"class": "val"}, it[1]));
    }));
  }

  // --- horizontal stacked bars against a capacity line ------------------------------------
  // rows: [{label, parts: [[name, bytes]], total, note}], colours by part name
  function barChart(id, rows, capacity, colours, lines) {
    var W = 940, left = 190, right = 170, rowH = 30, top = 26;
    var H = top + rows.length * rowH + 30;
    var max = Math.max.apply(null, [capacity].concat(rows.map(function (r) { return r.total; }))) * 1.02;
    function x(b) { return left + (W - left - right) * b / max; }
    var g = sv("svg", {id: id, "class": "chart", viewBox: "0 0 " + W + " " + H, width: W, height: H, role: "img"});
    rows.forEach(function (r, i) {
      var y = top + i * rowH, at = 0, row = sv("g", {"class": "bar", "data-row": String(i)});
      g.appendChild(row);
      row.appendChild(sv("text", {x: left - 8, y: y + rowH / 2 + 4, "text-anchor": "end", "class": "axis"}, r.label));
      r.parts.forEach(function (p) {
        if (p[1] <= 0) return;
        row.appendChild(sv("rect", {x: x(at), y: y + 4, width: Math.max(0.5, x(at + p[1]) - x(at)), height: rowH - 8,
                                  fill: colours[p[0]] || "#999", "data-part": p[0], "data-bytes": String(p[1])},
                         sv("title", null, p[0] + ": " + size(p[1]))));
        at += p[1];
      });
      row.appendChild(sv("text", {x: W - right + 10, y: y + rowH / 2 + 4, "class": "barlabel" + (capacity > 0 && r.total > capacity ? " over" : ""),
                                "data-bytes": String(r.total)}, size(r.total) + (r.note ? " " + r.note : "")));
    });
    (lines || [["capacity", capacity]]).forEach(function (ln, k) {
      g.appendChild(sv("line", {x1: x(ln[1]), x2: x(ln[1]), y1: top - 4, y2: H - 26, "class": k ? "budget" : "capacity"}));
      g.appendChild(sv("text", {x: x(ln[1]) + (k ? -4 : 4), y: top - 8, "text-anchor": k ? "end" : "start", "class": "axis"},
                       ln[0] + " " + size(ln[1])));
    });
    g.appendChild(sv("line", {x1: left, x2: left, y1: top, y2: H - 26, "class": "axisline"}));
    return g;
  }
  function legend(colours, used) {
    return el("div", {"class": "legend"}, Object.keys(colours).filter(function (k) { return !used || used[k]; }).map(function (k) {
      return el("span", null, el("i", {style: "background:" + colours[k]}), k);
    }));
  }

  // --- the estimate ----------------------------------------------------------------------
  var PARTS = {"parameters and buffers": "#4c72b0", "gradients": "#dd8452", "optimizer states": "#55a868",
               "activations and temporaries": "#c44e52", "optimizer-step temporaries": "#8172b3",
               "calibration correction": "#937860", "CUDA context and workspace": "#8c8c8c", "allocator share": "#bcbcbc"};
  var PHASES = ["forward", "backward", "optimizer"];
  function maxPhase(p) { return Math.max(p.forward_bytes, p.backward_bytes, p.optimizer_bytes); }

  // Stage s's peak split as memplan.report.plot_estimate.stage_parts splits it: the model states
  // alive in the peak phase at full size, the rest of the tensor peak, calibration, overheads.
  function stageParts(d, s) {
    var steady = maxPhase(s.phases.steady) >= maxPhase(s.phases.first_step);
    var phase = s.peak_phase.split(" ")[0];
    var states = [["parameters and buffers", s.params_bytes + s.buffers_bytes]];
    if (steady || phase === "optimizer") states.push(["optimizer states", s.optimizer_bytes]);
    if (phase === "optimizer" || d.workload.num_microbatches > 1 || (steady && d.workload.keep_grads))
      states.push(["gradients", s.grads_bytes]);
    var held = states.reduce(function (a, p) { return a + p[1]; }, 0);
    var rest = s.tensor_peak_bytes - held;
    if (rest < 0) { states = []; rest = s.tensor_peak_bytes; }
    var restName = phase === "optimizer" ? "optimizer-step temporaries" : "activations and temporaries";
    return states.concat([[restName, rest], ["calibration correction", s.calibration_bytes],
                          ["CUDA context and workspace", s.cuda_context_bytes + s.workspace_bytes],
                          ["allocator share", s.allocator_bytes]]);
  }

  function renderEstimate(d, prefix) {
    var worst = d.stages.filter(function (s) { return s.stage === d.most_loaded_stage; })[0] || d.stages[0];
    var L = d.layout, w = d.workload;
    var s0 = section(prefix + "summary", "Verdict");
    s0.appendChild(cards([
      ["model", d.model + " (" + (d.num_params / 1e9).toFixed(2) + " B parameters)"],
      ["GPUs", d.num_gpus + " x " + d.gpu + ", " + d.framework],
      ["layout", "tp " + L.tp + ", pp " + L.pp + (L.vpp > 1 ? " x vpp " + L.vpp : "") + ", dp " + L.dp + ", cp " + L.cp +
                 ", ep " + L.ep + ", ZeRO " + L.zero + (L.sp ? ", SP" : "") + (L.offload !== "none" ? ", offload " + L.offload : "")],
      ["workload", "mbs " + w.mbs + " x seq " + w.seq + ", gbs " + w.gbs + ", " + w.precision + ", " + w.optimizer + " " +
                   w.optimizer_impl + ", recompute " + w.recompute],
      ["peak (stage " + d.most_loaded_stage + ")", el("span", {id: prefix + "peak"}, bytesCell(d.peak_bytes, "gib"), " in " + d.peak_phase)],
      ["capacity", bytesCell(d.capacity_bytes, "gib")],
      ["headroom", bytesCell(d.headroom_bytes, "gib"), d.headroom_bytes < 0 ? "bad" : ""],
      ["verdict", d.fits ? "fits" : "does not fit", d.fits ? "good" : "bad"],
      ["step time", num(d.step_time_s, 3) + " s, " + Math.round(d.tokens_per_s_per_gpu) + " tokens/s per GPU, MFU " + num(d.mfu, 2)]
    ]));

    var s1 = section(prefix + "stages", "Stage peaks against the GPU's capacity",
      "Each bar is one rank of a pipeline stage at its peak: the model states alive in the peak phase at their full " +
      "size, the rest of the tensor peak (saved activations, loss logits, gradients in flight, buffers and temporaries; " +
      "at an optimizer-phase peak the step's temporaries), a calibration's correction, and the fixed overheads.");
    var used = {};
    var rows = d.stages.map(function (s) {
      var parts = stageParts(d, s);
      parts.forEach(function (p) { if (p[1] > 0) used[p[0]] = true; });
      return {label: "stage " + s.stage + " (" + s.num_layers + " layers)", parts: parts, total: s.peak_bytes,
              note: s.peak_bytes > d.capacity_bytes ? "does not fit" : "fits"};
    });
    s1.appendChild(barChart(prefix + "stage-bars", rows, d.capacity_bytes, PARTS));
    s1.appendChild(legend(PARTS, used));
    s1.appendChild(el("p", {"class": "intro"}, "Every term per stage, each at its full size (they are not all alive at once; " +
                      "the peak is the largest phase):"));
    s1.appendChild(table(prefix + "stage-table",
      ["stage", "layers", "params", "grads", "optimizer states", "activations (all in flight)", "optimizer temporaries",
       "loss", "ZeRO/DDP buffers", "overheads", "calibration", "peak", "peak phase"],
      d.stages.map(function (s) {
        return ["stage " + s.stage + (s.stage === d.most_loaded_stage ? " (most loaded)" : ""), String(s.num_layers),
                bytesCell(s.params_bytes, "gib"), bytesCell(s.grads_bytes, "gib"), bytesCell(s.optimizer_bytes, "gib"),
                el("span", null, bytesCell(s.activations_bytes, "gib"), " (" + s.microbatches_in_flight + " mb)"),
                bytesCell(s.optimizer_temp_bytes, "gib"), bytesCell(s.loss_bytes, "gib"), bytesCell(s.sharding_buffers_bytes, "gib"),
                bytesCell(s.cuda_context_bytes + s.workspace_bytes + s.allocator_bytes, "gib"), bytesCell(s.calibration_bytes, "gib"),
                el("strong", {"class": "stage-peak", "data-stage": String(s.stage)}, bytesCell(s.peak_bytes, "gib")), s.peak_phase];
      })));

    renderPhases(d, prefix);
    if (d.explanations && d.explanations.length) {
      var s3 = section(prefix + "why", "Why, and what would change it");
      s3.appendChild(el("ul", null, d.explanations.map(function (e) {
        return el("li", null, el("strong", null, e.term.replace(/_bytes$/, "").replace(/_/g, " ")), ": " + e.why,
                  e.change ? el("div", {"class": "change"}, "change: " + e.change +
                    (e.peak_bytes_after !== null ? " (peak after: " + gib(e.peak_bytes_after) + ")" : "")) : null);
      })));
    }
    renderAssumptions(d, prefix);
  }

  function renderPhases(d, prefix) {
    var s = section(prefix + "phases", "Phase timeline: step 1 and the steady state",
      "Tensor bytes alive at each phase's peak, per stage (without the fixed overheads: CUDA context, workspace, " +
      "allocator share). Step 1 has no optimizer states before its optimizer step; from step 2 on they are alive throughout." +
      (d.stages.some(function (t) { return t.analytic_phases; }) ? " Calibrated: the analytic phases are in the JSON beside them." : ""));
    var slots = [];
    ["first_step", "steady"].forEach(function (when) {
      PHASES.forEach(function (ph) { slots.push([when, ph]); });
    });
    var W = 900, left = 80, right = 150, top = 20, H = 300, bottom = 50;
    var max = 0;
    d.stages.forEach(function (t) { slots.forEach(function (sl) { max = Math.max(max, t.phases[sl[0]][sl[1] + "_bytes"]); }); });
    var cap = d.capacity_bytes, showCap = cap <= max * 1.6;
    var ymax = (showCap ? Math.max(max, cap) : max) * 1.08 || 1;
    function X(i) { return left + (W - left - right) * (i + 0.5) / slots.length; }
    function Y(b) { return top + (H - top - bottom) * (1 - b / ymax); }
    var g = sv("svg", {id: prefix + "phase-chart", "class": "chart", viewBox: "0 0 " + W + " " + H, width: W, height: H, role: "img"});
    g.appendChild(sv("rect", {x: left, y: top, width: (W - left - right) / 2, height: H - top - bottom, "class": "band"}));
    g.appendChild(sv("text", {x: left + (W - left - right) / 4, y: H - 8, "text-anchor": "middle", "class": "axis"}, "step 1"));
    g.appendChild(sv("text", {x: left + 3 * (W - left - right) / 4, y: H - 8, "text-anchor": "middle", "class": "axis"}, "steady state"));
    slots.forEach(function (sl, i) {
      g.appendChild(sv("text", {x: X(i), y: H - bottom + 16, "text-anchor": "middle", "class": "axis"}, sl[1]));
    });
    for (var k = 0; k <= 4; k++) {
      var b = Math.round(ymax * k / 4);
      g.appendChild(sv("line", {x1: left, x2: W - right, y1: Y(b), y2: Y(b), "class": "grid"}));
      g.appendChild(sv("text", {x: left - 6, y: Y(b) + 4, "text-anchor": "end", "class": "axis"}, size(b)));
    }
    if (showCap) {
      g.appendChild(sv("line", {x1: left, x2: W - right, y1: Y(cap), y2: Y(cap), "class": "capacity"}));
      g.appendChild(sv("text", {x: left + 4, y: Y(cap) - 4, "class": "axis"}, "capacity " + gib(cap)));
    }
    d.stages.forEach(function (t, j) {
      var colour = "hsl(" + Math.round(360 * j / Math.max(1, d.stages.length)) + ",60%,42%)";
      var pts = slots.map(function (sl, i) { return X(i) + "," + Y(t.phases[sl[0]][sl[1] + "_bytes"]); });
      g.appendChild(sv("polyline", {points: pts.join(" "), fill: "none", stroke: colour, "stroke-width": 2}));
      slots.forEach(function (sl, i) {
        var v = t.phases[sl[0]][sl[1] + "_bytes"];
        g.appendChild(sv("circle", {cx: X(i), cy: Y(v), r: 4, fill: colour},
                         sv("title", null, "stage " + t.stage + ", " + (sl[0] === "steady" ? "steady " : "step 1 ") + sl[1] + ": " + size(v))));
      });
      g.appendChild(sv("text", {x: W - right + 4, y: top + 14 + 14 * j, style: "fill:" + colour}, "stage " + t.stage));
    });
    s.appendChild(g);
    s.appendChild(table(prefix + "phase-table", ["stage", "step 1 forward", "step 1 backward", "step 1 optimizer",
                                                  "steady forward", "steady backward", "steady optimizer"],
      d.stages.map(function (t) {
        return ["stage " + t.stage].concat(slots.map(function (sl) { return bytesCell(t.phases[sl[0]][sl[1] + "_bytes"], "gib"); }));
      })));
  }

  function renderAssumptions(d, prefix) {
    var s = section(prefix + "assumptions", "Assumptions and their sources",
      "What the estimate takes as given, each with where it comes from (the framework's code, a trace, a measurement).");
    s.appendChild(table(prefix + "assumption-table", ["what", "assumed, and its source"], (d.assumptions || []).map(function (a) {
      var at = a.indexOf(": ");
      return at > 0 && at < 40 ? [a.slice(0, at), a.slice(at + 2)] : ["", a];
    })));
    if (d.caveats && d.caveats.length) {
      s.appendChild(el("h3", null, "Caveats"));
      s.appendChild(el("ul", null, d.caveats.map(function (c) { return el("li", null, c); })));
    }
    if (d.calibration) { s.appendChild(el("h3", null, "Calibration")); s.appendChild(keyValues(d.calibration)); }
    if (d.config) { s.appendChild(el("h3", null, "Read from the job's config")); s.appendChild(keyValues(d.config)); }
  }

  // --- plan ------------------------------------------------------------------------------
  function layoutText(L) {
    return "tp " + L.tp + ", pp " + L.pp + (L.vpp > 1 ? " x " + L.vpp : "") + ", dp " + L.dp + ", cp " + L.cp + ", ep " + L.ep +
           ", ZeRO " + L.zero + (L.sp ? ", SP" : "");
  }
  function renderPlan(d) {
    var c = d.candidates;
    var s0 = section("summary", "Verdict");
    s0.appendChild(cards([
      ["fits", c.length ? c.length + " candidate" + (c.length > 1 ? "s" : "") + " shown" : "none fits", c.length ? "good" : "bad"],
      ["fastest", c.length ? layoutText(c[0].layout) + ", mbs " + c[0].mbs + ", recompute " + c[0].recompute : "n/a"],
      ["global batch", String(d.global_batch_size)],
      ["searched", d.searched + " layouts, " + d.evaluated + " estimates"],
      ["budget", el("span", null, bytesCell(d.budget_bytes, "gib"), " (capacity less the safety margin)")]
    ]));
    if (c.length) {
      var capacity = c[0].capacity_bytes;
      var s1 = section("candidates", "Candidates, fastest first: peak against capacity");
      var colours = {"peak of the most loaded rank": "#4c72b0"};
      s1.appendChild(barChart("candidate-bars", c.map(function (k, i) {
        return {label: "#" + (i + 1) + " tp" + k.layout.tp + " pp" + k.layout.pp + " dp" + k.layout.dp + " mbs " + k.mbs,
                parts: [["peak of the most loaded rank", k.peak_bytes]], total: k.peak_bytes, note: num(k.step_time_s, 2) + " s"};
      }), capacity, colours, [["capacity", capacity], ["budget", d.budget_bytes]]));
      s1.appendChild(table("candidate-table", ["#", "layout", "mbs", "recompute", "peak", "capacity", "step time", "tokens/s/GPU", "MFU", "bound"],
        c.map(function (k, i) {
          return [String(i + 1), layoutText(k.layout), String(k.mbs), k.recompute + (k.recompute_layers !== null ? " (" + k.recompute_layers + " layers)" : ""),
                  el("strong", {"class": "candidate-peak"}, bytesCell(k.peak_bytes, "gib")), bytesCell(k.capacity_bytes, "gib"),
                  num(k.step_time_s, 3) + " s", String(Math.round(k.tokens_per_s_per_gpu)), num(k.mfu, 2), k.bound];
        })));
    }
    var s2 = section("rejected", "What the search ruled out");
    s2.appendChild(table("rejected-table", ["reason", "count"], Object.keys(d.rejected).map(function (k) { return [k, String(d.rejected[k])]; })));
    if (d.closest_miss) {
      s2.appendChild(el("h3", null, "Closest miss"));
      s2.appendChild(el("p", null, layoutText(d.closest_miss.layout) + ", mbs " + d.closest_miss.mbs + ", recompute " + d.closest_miss.recompute +
                         ": peak ", bytesCell(d.closest_miss.peak_bytes, "gib"), " on stage " + d.closest_miss.stage +
                         (d.oom_excess_bytes !== null ? ", " + gib(d.oom_excess_bytes) + " over the budget" : "")));
    }
    if (d.no_fit) { s2.appendChild(el("h3", null, "Why nothing fits")); s2.appendChild(keyValues(d.no_fit)); }
    if (d.savers) { s2.appendChild(el("h3", null, "What would make it fit")); s2.appendChild(keyValues(d.savers)); }
    if (d.config) { s2.appendChild(el("h3", null, "Read from the job's config")); s2.appendChild(keyValues(d.config)); }
  }

  var FITS = {"fits": "#55a868", "does not fit": "#c44e52"};
  // --- diagnose --------------------------------------------------------------------------
  function renderDiagnose(d) {
    var s0 = section("summary", "Diagnosis");
    s0.appendChild(cards([
      ["fails in", d.failing_phase + " of the " + d.failing_step + ", stage " + d.failing_stage, "bad"],
      ["largest part", el("span", null, d.dominant.component + ": ", bytesCell(d.dominant.bytes, "gib"))],
      ["capacity", el("span", null, bytesCell(d.capacity_bytes, "gib"), " (" + d.capacity_source + ")")],
      ["bound", d.utilisation.bound + ", step " + num(d.utilisation.step_time_s, 3) + " s, MFU " + num(d.utilisation.mfu, 2)]
    ]));
    s0.appendChild(el("ul", {id: "findings"}, d.findings.map(function (f) {
      return el("li", {"class": f.cause ? "cause" : ""}, el("strong", null, f.kind + (f.cause ? " (cause)" : "")), ": " + f.message);
    })));
    var comp = {};
    Object.keys(d.components_bytes).forEach(function (k, i) { comp[k] = ["#4c72b0", "#c44e52", "#55a868", "#dd8452", "#8172b3", "#937860", "#8c8c8c"][i % 7]; });
    s0.appendChild(el("h3", null, "The failing phase's tensors against capacity"));
    // the named components, and the rest of the failing phase's tensors when a finding gives
    // the phase's bytes
    var parts = Object.keys(d.components_bytes).map(function (k) { return [k, d.components_bytes[k]]; });
    var named = parts.reduce(function (a, p) { return a + p[1]; }, 0);
    var phase = d.findings.map(function (f) { return f.sizes && f.sizes.phase_bytes; }).filter(Number.isInteger)[0];
    if (phase > named) { parts.push(["other tensors", phase - named]); comp["other tensors"] = "#bcbcbc"; }
    s0.appendChild(barChart("component-bars", [{label: d.failing_phase + " (stage " + d.failing_stage + ")",
      parts: parts, total: Math.max(named, phase || 0)}], d.capacity_bytes, comp));
    s0.appendChild(legend(comp));
    if (d.oom) { var so = section("oom", "The out-of-memory error"); so.appendChild(keyValues(d.oom)); }
    if (d.monitor) { var sm = section("monitor", "Measured by the monitor"); sm.appendChild(keyValues(d.monitor)); }
    if (d.fixes && d.fixes.length) {
      var sf = section("fixes", "Fixes, re-estimated", "Each fix is the same configuration re-estimated with the change; its peak against the capacity.");
      sf.appendChild(barChart("fix-bars", d.fixes.map(function (f, i) {
        var name = f.name.length > 26 ? f.name.slice(0, 25) + "\u2026" : f.name;
        return {label: "#" + (i + 1) + " " + name, parts: [[f.fits ? "fits" : "does not fit", f.peak_bytes]], total: f.peak_bytes,
                note: f.fits ? "fits" : "does not fit"};
      }), d.capacity_bytes, FITS));
      sf.appendChild(legend(FITS));
      sf.appendChild(table("fix-table", ["#", "fix", "flags", "peak", "saved", "fits", "step time", "note"], d.fixes.map(function (f, i) {
        return [String(i + 1), f.name, el("code", null, f.flags), bytesCell(f.peak_bytes, "gib"), bytesCell(f.saved_bytes, "gib"),
                f.fits ? "yes" : "no", num(f.step_time_s, 3) + " s", f.note || ""];
      })));
      if (d.not_applicable && d.not_applicable.length)
        sf.appendChild(el("ul", null, d.not_applicable.map(function (n) { return el("li", null, n.name + ": " + n.reason); })));
    }
    var su = section("utilisation", "Step time and what bounds it"); su.appendChild(keyValues(d.utilisation));
    var h = el("h2", {"class": "part"}, "The estimate of this configuration");
    document.getElementById("report").appendChild(h);
    renderEstimate(d.estimate, "estimate-");
  }

  // --- profile ---------------------------------------------------------------------------
  var CATS = {parameters: "#4c72b0", gradients: "#dd8452", optimizer: "#55a868", activations: "#c44e52", temporaries: "#8172b3"};
  function renderProfile(d) {
    var s0 = section("summary", "Measured");
    s0.appendChild(cards([
      ["model", d.model], ["device", d.device], ["steps", String(d.num_steps)],
      ["first step peak", bytesCell(d.first_step.first_step_peak_bytes)],
      ["steady peak (step " + d.first_step.steady_step + ")", bytesCell(d.first_step.steady_peak_bytes)]
    ]));
    s0.appendChild(el("p", {"class": "intro"}, "measured: " + d.source));
    if (d.predicted) s0.appendChild(el("p", {"class": "intro"}, "predicted: " + d.predicted.source));
    var rows = d.measured_vs_predicted || [];
    if (rows.length) {
      var s1 = section("measured-vs-predicted", "Predicted beside measured, by phase");
      var W = 900, left = 80, top = 20, H = 280, bottom = 46, right = 20;
      var max = Math.max.apply(null, rows.map(function (r) { return Math.max(r.measured_bytes, r.predicted_bytes); })) * 1.1 || 1;
      var g = sv("svg", {id: "mvp-chart", "class": "chart", viewBox: "0 0 " + W + " " + H, width: W, height: H, role: "img"});
      var slot = (W - left - right) / rows.length;
      function Y(b) { return top + (H - top - bottom) * (1 - b / max); }
      for (var k = 0; k <= 4; k++) {
        var b = Math.round(max * k / 4);
        g.appendChild(sv("line", {x1: left, x2: W - right, y1: Y(b), y2: Y(b), "class": "grid"}));
        g.appendChild(sv("text", {x: left - 6, y: Y(b) + 4, "text-anchor": "end", "class": "axis"}, size(b)));
      }
      rows.forEach(function (r, i) {
        var x0 = left + i * slot + slot * 0.15, bw = slot * 0.33;
        [["measured", r.measured_bytes, "#4c72b0"], ["predicted", r.predicted_bytes, "#dd8452"]].forEach(function (m, j) {
          g.appendChild(sv("rect", {x: x0 + j * bw, y: Y(m[1]), width: bw - 2, height: Y(0) - Y(m[1]), fill: m[2], "data-bytes": String(m[1])},
                           sv("title", null, m[0] + ", step " + r.step + " " + r.phase + ": " + size(m[1]))));
        });
        g.appendChild(sv("text", {x: left + (i + 0.5) * slot, y: H - bottom + 16, "text-anchor": "middle", "class": "axis"}, r.phase));
        g.appendChild(sv("text", {x: left + (i + 0.5) * slot, y: H - bottom + 30, "text-anchor": "middle", "class": "axis"}, "step " + r.step + " (" + r.label.replace("_", " ") + ")"));
      });
      s1.appendChild(g);
      s1.appendChild(legend({measured: "#4c72b0", predicted: "#dd8452"}));
      s1.appendChild(table("mvp-table", ["step", "phase", "measured", "predicted", "predicted - measured", "of measured"], rows.map(function (r) {
        return ["step " + r.step + " (" + r.label.replace("_", " ") + ")", r.phase, el("strong", {"class": "measured"}, bytesCell(r.measured_bytes)),
                bytesCell(r.predicted_bytes), exactBytes(r.diff_bytes), r.diff_pct === null ? "n/a" : r.diff_pct.toFixed(4) + "%"];
      })));
    }
    var s2 = section("phases-measured", "Measured peaks by step, phase and category",
      "Each bar is the bytes alive at a phase's measured peak, split by what they are.");
    var bars = [];
    Object.keys(d.phases).forEach(function (step) {
      Object.keys(d.phases[step]).forEach(function (ph) {
        var p = d.phases[step][ph];
        var parts = Object.keys(CATS).map(function (c) { return [c, p.by_category[c] || 0]; });
        var other = p.peak_bytes - parts.reduce(function (a, q) { return a + q[1]; }, 0);
        if (other > 0) parts.push(["other", other]);
        bars.push({label: "step " + step + " " + ph, parts: parts, total: p.peak_bytes});
      });
    });
    var cats = Object.assign({}, CATS, {other: "#bcbcbc"});
    s2.appendChild(barChart("measured-bars", bars, 0, cats, []));
    s2.appendChild(legend(cats));
    var f = d.first_step, s3 = section("first-step", "Step 1 against later steps");
    s3.appendChild(el("ul", null, f.causes.map(function (c) { return el("li", null, c.cause.replace(/_/g, " ") + ": ", bytesCell(c.bytes), " (" + c.why + ")"); })));
    if (f.warnings.length) s3.appendChild(el("ul", {"class": "warnings"}, f.warnings.map(function (x) { return el("li", null, "warning: " + x); })));
    if (d.perf) { var sp = section("perf", "Time (torch.profiler)"); sp.appendChild(keyValues(d.perf)); }
    if (d.files && d.files.length) { var sfl = section("files", "Files written"); sfl.appendChild(keyValues(d.files)); }
  }

  function render() {
    var d = JSON.parse(document.getElementById("memplan-data").textContent);
    var draw = {estimate: function () { renderEstimate(d, ""); }, plan: function () { renderPlan(d); },
                diagnose: function () { renderDiagnose(d); }, profile: function () { renderProfile(d); }}[d.command];
    if (!draw) throw new Error("no page for command " + d.command);
    draw();
    var fb = document.getElementById("fallback");
    if (fb) fb.open = false;
    document.body.setAttribute("data-rendered", "ok");
  }
  try { render(); } catch (e) { fail("render failed: " + (e && e.stack || e)); document.body.setAttribute("data-rendered", "failed"); }
  // every resource the page loaded (none is allowed: the page is one file)
  document.body.setAttribute("data-resources", String(performance.getEntriesByType("resource").length));
})();

// jaxmem report viewer: draws the charts from the JSON embedded in the page. No network, no
// libraries. Every string from user code reaches the page through textContent, never as HTML.
"use strict";
(function () {
  var status = document.getElementById("status");
  var errors = [];
  function fail(msg) {
    errors.push(String(msg));
    status.setAttribute("data-errors", String(errors.length));
    status.textContent = "report errors: " + errors.join(" | ");
  }
  window.addEventListener("error", function (e) { fail(e.message || e); });

  var D = JSON.parse(document.getElementById("report-data").textContent);
  var tip = document.getElementById("tip");
  var DPR = window.devicePixelRatio || 1;
  var view = { x0: D.xMin, x1: D.xMax };
  var PAD = { l: 72, r: 16, t: 12, b: 26 };

  function fmt(n) {
    var u = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0, v = Math.abs(n);
    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return (n < 0 ? "-" : "") + (i ? v.toFixed(2) : String(Math.round(v))) + " " + u[i];
  }
  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function showTip(ev, lines) {
    tip.textContent = lines.join("\n");
    tip.style.display = "block";
    var x = ev.clientX + 14, y = ev.clientY + 14;
    var w = tip.offsetWidth, h = tip.offsetHeight;
    if (x + w > window.innerWidth - 4) x = ev.clientX - w - 10;
    if (y + h > window.innerHeight - 4) y = ev.clientY - h - 10;
    tip.style.left = x + "px"; tip.style.top = y + "px";
  }
  function hideTip() { tip.style.display = "none"; }

  // A chart is a base canvas (redrawn on zoom) and an overlay canvas (hover marks).
  function makeChart(id, height) {
    var host = document.getElementById(id);
    var width = Math.max(480, host.clientWidth - 2);
    var base = el("canvas"), over = el("canvas", null, "overlay");
    [base, over].forEach(function (c) {
      c.width = width * DPR; c.height = height * DPR;
      c.style.width = width + "px"; c.style.height = height + "px";
      host.appendChild(c);
    });
    var chart = { host: host, base: base, over: over, w: width, h: height,
                  ctx: base.getContext("2d"), octx: over.getContext("2d") };
    chart.ctx.scale(DPR, DPR); chart.octx.scale(DPR, DPR);
    chart.px = function (x) { return PAD.l + (x - view.x0) / Math.max(1e-9, view.x1 - view.x0 + 1) * (width - PAD.l - PAD.r); };
    chart.xAt = function (px) { return view.x0 + (px - PAD.l) / (width - PAD.l - PAD.r) * (view.x1 - view.x0 + 1); };
    return chart;
  }
  function axes(ch, ymax, ylabel) {
    var c = ch.ctx, h = ch.h, w = ch.w;
    c.strokeStyle = "#c8ced8"; c.fillStyle = "#5b6472"; c.font = "11px system-ui, sans-serif"; c.lineWidth = 1;
    c.beginPath(); c.moveTo(PAD.l, PAD.t); c.lineTo(PAD.l, h - PAD.b); c.lineTo(w - PAD.r, h - PAD.b); c.stroke();
    for (var i = 0; i <= 4; i++) {
      var v = ymax * i / 4, y = h - PAD.b - (h - PAD.t - PAD.b) * i / 4;
      c.fillText(ylabel(v), 4, y + 4);
      c.strokeStyle = "#eef0f4"; c.beginPath(); c.moveTo(PAD.l + 1, y); c.lineTo(w - PAD.r, y); c.stroke();
    }
    var span = view.x1 - view.x0 + 1, step = Math.max(1, Math.pow(10, Math.floor(Math.log10(span / 4))));
    while (span / step > 10) step *= 2;
    for (var x = Math.ceil(view.x0 / step) * step; x <= view.x1; x += step) {
      var label = String(x), lw = c.measureText(label).width;
      c.fillText(label, Math.max(PAD.l - lw / 2, Math.min(ch.px(x) - lw / 2, w - PAD.r - lw)), h - 8);
    }
    c.fillText(D.xLabel, w - PAD.r - c.measureText(D.xLabel).width, h - 8 - 12);
  }
  function yOf(ch, v, ymax) { return ch.h - PAD.b - (ch.h - PAD.t - PAD.b) * v / Math.max(1, ymax); }
  function peakLine(ch, label) {
    var c = ch.ctx, x = ch.px(D.peak.x + 0.5);
    if (x < PAD.l || x > ch.w - PAD.r) return;
    c.save(); c.strokeStyle = "#c62828"; c.setLineDash([4, 3]); c.lineWidth = 1.2;
    c.beginPath(); c.moveTo(x, PAD.t); c.lineTo(x, ch.h - PAD.b); c.stroke(); c.restore();
    if (label) { c.fillStyle = "#c62828"; c.font = "bold 11px system-ui, sans-serif";
      c.fillText(label, Math.min(x + 4, ch.w - PAD.r - c.measureText(label).width), PAD.t + 11); }
  }
  function visibleRange(xs) {  // indices of xs inside the view, one beyond on each side
    var lo = 0, hi = xs.length - 1;
    while (lo < hi && xs[lo + 1] < view.x0) lo++;
    while (hi > lo && xs[hi - 1] > view.x1) hi--;
    return [lo, hi];
  }

  // ---- stacked area: live memory by category over the schedule ---------------------------
  function drawStacked(ch) {
    var P = D.points, c = ch.ctx, n = P.x.length;
    c.clearRect(0, 0, ch.w, ch.h);
    var r = visibleRange(P.x), ymax = 1;
    for (var i = r[0]; i <= r[1]; i++) ymax = Math.max(ymax, P.total[i]);
    ymax *= 1.08;
    axes(ch, ymax, fmt);
    var base = new Float64Array(n);
    D.categories.forEach(function (cat, k) {
      var col = P.cols[k];
      c.beginPath();
      for (var i = r[0]; i <= r[1]; i++) {
        var x0 = ch.px(P.x[i]), x1 = ch.px(i + 1 < n ? P.x[i + 1] : P.x[i] + 1), y = yOf(ch, base[i] + col[i], ymax);
        if (i === r[0]) c.moveTo(x0, y); else c.lineTo(x0, y);
        c.lineTo(x1, y);
      }
      for (var j = r[1]; j >= r[0]; j--) {
        var xa = ch.px(P.x[j]), xb = ch.px(j + 1 < n ? P.x[j + 1] : P.x[j] + 1), yb = yOf(ch, base[j], ymax);
        c.lineTo(xb, yb); c.lineTo(xa, yb);
      }
      c.closePath(); c.fillStyle = D.colors[cat]; c.fill();
      for (var q = r[0]; q <= r[1]; q++) base[q] += col[q];
    });
    if (D.capacity && D.capacity < ymax) {
      var yc = yOf(ch, D.capacity, ymax);
      c.strokeStyle = "#000"; c.setLineDash([2, 2]); c.beginPath(); c.moveTo(PAD.l, yc); c.lineTo(ch.w - PAD.r, yc); c.stroke(); c.setLineDash([]);
    }
    peakLine(ch, "peak " + fmt(D.peak.bytes) + " at " + D.xLabel + " " + D.peak.x);
    ch.ymax = ymax;
  }
  function pointAt(x) {  // the downsampled point covering x
    var xs = D.points.x, lo = 0, hi = xs.length - 1;
    while (lo < hi) { var mid = (lo + hi + 1) >> 1; if (xs[mid] <= x) lo = mid; else hi = mid - 1; }
    return lo;
  }
  function stackedHover(ch, ev) {
    var rect = ch.over.getBoundingClientRect(), px = ev.clientX - rect.left;
    var x = Math.floor(ch.xAt(px)), o = ch.octx;
    o.clearRect(0, 0, ch.w, ch.h);
    if (x < view.x0 || x > view.x1) { hideTip(); return; }
    var i = pointAt(x), P = D.points;
    o.strokeStyle = "#1d2430"; o.beginPath(); o.moveTo(ch.px(P.x[i] + 0.5), PAD.t); o.lineTo(ch.px(P.x[i] + 0.5), ch.h - PAD.b); o.stroke();
    var lines = [D.xLabel + " " + P.x[i] + ": " + P.names[i], "live " + fmt(P.total[i])];
    D.categories.forEach(function (cat, k) { if (P.cols[k][i]) lines.push("  " + cat + ": " + fmt(P.cols[k][i])); });
    if (P.span[i] > 1) lines.push("(largest of " + P.span[i] + " " + D.xLabel + "s drawn here)");
    showTip(ev, lines);
  }

  // ---- lines: in use and reserved per allocator (replays) ---------------------------------
  var PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f"];
  function drawLines(ch) {
    var c = ch.ctx, ymax = 1;
    c.clearRect(0, 0, ch.w, ch.h);
    D.allocators.forEach(function (a) {
      var r = visibleRange(a.x);
      for (var i = r[0]; i <= r[1]; i++) ymax = Math.max(ymax, a.reserved[i], a.inUse[i]);
    });
    if (D.capacity) ymax = Math.max(ymax, D.capacity);
    ymax *= 1.08;
    axes(ch, ymax, fmt);
    D.allocators.forEach(function (a, k) {
      var r = visibleRange(a.x), color = PALETTE[k % PALETTE.length];
      [["inUse", []], ["reserved", [5, 3]]].forEach(function (spec) {
        var ys = a[spec[0]];
        c.strokeStyle = color; c.lineWidth = 1.4; c.setLineDash(spec[1]); c.beginPath();
        for (var i = r[0]; i <= r[1]; i++) {
          var x = ch.px(a.x[i]), y = yOf(ch, ys[i], ymax);
          if (i === r[0]) c.moveTo(x, y); else c.lineTo(x, y);
        }
        c.stroke();
      });
      c.setLineDash([]);
      if (a.oomX !== null && a.oomX >= view.x0 && a.oomX <= view.x1) {
        var ox = ch.px(a.oomX), oy = yOf(ch, a.peakReserved, ymax);
        c.fillStyle = color; c.beginPath(); c.moveTo(ox, oy - 7); c.lineTo(ox + 6, oy + 5); c.lineTo(ox - 6, oy + 5); c.closePath(); c.fill();
        c.font = "bold 11px system-ui, sans-serif"; c.fillText("OOM: " + a.name, ox + 8, oy + 4);
      }
    });
    if (D.capacity) {
      var yc = yOf(ch, D.capacity, ymax);
      c.strokeStyle = "#000"; c.setLineDash([2, 2]); c.beginPath(); c.moveTo(PAD.l, yc); c.lineTo(ch.w - PAD.r, yc); c.stroke(); c.setLineDash([]);
      c.fillStyle = "#000"; c.fillText("capacity " + fmt(D.capacity), PAD.l + 4, yc - 4);
    }
    ch.ymax = ymax;
  }
  function linesHover(ch, ev) {
    var rect = ch.over.getBoundingClientRect(), x = Math.round(ch.xAt(ev.clientX - rect.left)), o = ch.octx;
    o.clearRect(0, 0, ch.w, ch.h);
    if (x < view.x0 || x > view.x1) { hideTip(); return; }
    o.strokeStyle = "#1d2430"; o.beginPath(); o.moveTo(ch.px(x), PAD.t); o.lineTo(ch.px(x), ch.h - PAD.b); o.stroke();
    var lines = ["event " + x];
    D.allocators.forEach(function (a) {
      var xs = a.x, lo = 0, hi = xs.length - 1;
      while (lo < hi) { var mid = (lo + hi + 1) >> 1; if (xs[mid] <= x) lo = mid; else hi = mid - 1; }
      lines.push(a.name + ": in use " + fmt(a.inUse[lo]) + ", reserved " + fmt(a.reserved[lo]) + (a.oomX !== null && x >= a.oomX ? "  (out of memory at " + a.oomX + ")" : ""));
    });
    showTip(ev, lines);
  }

  // ---- placement map: address against time, one rectangle per block ----------------------
  var B = D.blocks, G = D.aggregates;
  function drawMap(ch) {
    var c = ch.ctx, top = Math.max(1, D.addressTop);
    c.clearRect(0, 0, ch.w, ch.h);
    axes(ch, top, fmt);
    var H = ch.h - PAD.t - PAD.b, L = PAD.l, R = ch.w - PAD.r;
    function rects(set, alphaOf) {
      var byCat = D.categories.map(function () { return []; });
      for (var i = 0; i < set.addr.length; i++) {
        if (set.end[i] < view.x0 || set.start[i] > view.x1) continue;
        byCat[set.cat[i]].push(i);
      }
      byCat.forEach(function (idx, k) {
        c.fillStyle = D.colors[D.categories[k]];
        var alpha = 1;
        idx.forEach(function (i) {
          var x0 = Math.max(L, ch.px(set.start[i])), x1 = Math.min(R, ch.px(set.end[i] + 1));
          var y1 = ch.h - PAD.b - set.addr[i] / top * H, y0 = ch.h - PAD.b - (set.addr[i] + set.size[i]) / top * H;
          var a = alphaOf ? alphaOf(i) : 0.9;
          if (a !== alpha) { c.globalAlpha = a; alpha = a; }
          // Never thinner than a pixel, so a small buffer is still seen and can be hovered.
          c.fillRect(x0, y0, Math.max(1, x1 - x0 - 0.3), Math.max(1, y1 - y0 - 0.3));
        });
        c.globalAlpha = 1;
      });
    }
    rects(G, function (i) { return 0.25 + 0.6 * Math.min(1, G.fill[i]); });
    rects(B, null);
    if (D.callerBase !== null) {
      var yc = ch.h - PAD.b - D.callerBase / top * H;
      c.strokeStyle = "#1d2430"; c.setLineDash([6, 3]); c.beginPath(); c.moveTo(L, yc); c.lineTo(R, yc); c.stroke(); c.setLineDash([]);
      c.fillStyle = "#1d2430"; c.fillText("arena top; above: arguments kept in the caller's memory", L + 4, yc - 4);
    }
    peakLine(ch, D.kind === "plan" ? "peak" : "");
  }
  function hitBlock(ch, ev) {  // a linear scan of typed columns: ~1 ms for 100,000 blocks
    var rect = ch.over.getBoundingClientRect(), px = ev.clientX - rect.left, py = ev.clientY - rect.top;
    var x = ch.xAt(px), top = Math.max(1, D.addressTop), H = ch.h - PAD.t - PAD.b;
    var addr = (ch.h - PAD.b - py) / H * top, slack = top / H * 1.5;  // 1.5 px of slack for thin ones
    var best = -1, bestSize = Infinity;
    for (var i = 0; i < B.addr.length; i++) {
      if (x < B.start[i] || x >= B.end[i] + 1) continue;
      var a = B.addr[i], s = B.size[i];
      if (addr >= a - slack && addr < a + s + slack && s < bestSize) { best = i; bestSize = s; }
    }
    if (best >= 0) return { kind: "block", i: best };
    for (var j = 0; j < G.addr.length; j++) {
      if (x >= G.start[j] && x < G.end[j] + 1 && addr >= G.addr[j] - slack && addr < G.addr[j] + G.size[j] + slack) return { kind: "agg", i: j };
    }
    return null;
  }
  function blockLines(i) {
    var info = D.info[B.info[i]];  // [label, shape, dtype, source, region]
    var lines = [fmt(B.size[i]) + "  " + D.categories[B.cat[i]] + (info[4] === "caller" ? " (caller's memory)" : "")];
    if (info[2] || info[1]) lines.push(info[2] + "[" + info[1] + "]");
    if (info[0]) lines.push("op: " + info[0]);
    lines.push(D.xLabel + "s " + B.start[i] + " .. " + B.end[i] + ", at " + fmt(B.addr[i])
               + (D.kind === "plan" ? (info[4] === "caller" ? " (above the arena)" : " in the arena") : " (unused gaps removed)"));
    lines.push(info[3] ? "source: " + info[3] : "source: unknown");
    return lines;
  }
  function outline(ch, i) {
    var o = ch.octx, top = Math.max(1, D.addressTop), H = ch.h - PAD.t - PAD.b;
    var x0 = Math.max(PAD.l, ch.px(B.start[i])), x1 = Math.min(ch.w - PAD.r, ch.px(B.end[i] + 1));
    var y1 = ch.h - PAD.b - B.addr[i] / top * H, y0 = ch.h - PAD.b - (B.addr[i] + B.size[i]) / top * H;
    o.strokeStyle = "#000"; o.lineWidth = 2; o.strokeRect(x0, y0, Math.max(2, x1 - x0), Math.max(2, y1 - y0));
  }
  function mapHover(ch, ev) {
    ch.octx.clearRect(0, 0, ch.w, ch.h);
    var hit = hitBlock(ch, ev);
    if (!hit) { hideTip(); return; }
    if (hit.kind === "block") { outline(ch, hit.i); showTip(ev, blockLines(hit.i)); return; }
    var j = hit.i;
    showTip(ev, [G.count[j] + " small " + D.categories[G.cat[j]] + " blocks drawn as one (each too small to see)",
                 "total " + fmt(G.bytes[j]) + ", " + D.xLabel + "s " + G.start[j] + " .. " + G.end[j]]);
  }

  // ---- zoom: drag across a chart to zoom the time axis, double-click to reset -------------
  var charts = [];
  function redraw() { charts.forEach(function (ch) { ch.draw(ch); }); }
  function wire(ch, hover) {
    var drag = null;
    ch.over.addEventListener("mousemove", function (ev) {
      if (drag !== null) {
        var rect = ch.over.getBoundingClientRect(), px = ev.clientX - rect.left, o = ch.octx;
        o.clearRect(0, 0, ch.w, ch.h); o.fillStyle = "rgba(30,80,200,.12)";
        o.fillRect(Math.min(drag, px), PAD.t, Math.abs(px - drag), ch.h - PAD.t - PAD.b); return;
      }
      hover(ch, ev);
    });
    ch.over.addEventListener("mouseleave", function () { ch.octx.clearRect(0, 0, ch.w, ch.h); hideTip(); });
    ch.over.addEventListener("mousedown", function (ev) { drag = ev.clientX - ch.over.getBoundingClientRect().left; });
    ch.over.addEventListener("mouseup", function (ev) {
      var px = ev.clientX - ch.over.getBoundingClientRect().left;
      if (drag !== null && Math.abs(px - drag) > 4) {
        var a = Math.floor(ch.xAt(Math.min(drag, px))), b = Math.ceil(ch.xAt(Math.max(drag, px)));
        view.x0 = Math.max(D.xMin, a); view.x1 = Math.min(D.xMax, Math.max(b, view.x0 + 1));
        redraw();
      }
      drag = null;
    });
    ch.over.addEventListener("dblclick", function () { view.x0 = D.xMin; view.x1 = D.xMax; redraw(); });
    charts.push(ch);
  }

  // ---- page -------------------------------------------------------------------------------
  function legend(id) {
    var host = document.getElementById(id);
    D.categories.forEach(function (cat) {
      var s = el("span"), sw = el("i");
      sw.style.background = D.colors[cat]; s.appendChild(sw); s.appendChild(el("span", cat.replace("_", " ")));
      host.appendChild(s);
    });
  }
  function summary() {
    var tb = document.getElementById("summary");
    D.summary.forEach(function (row) {
      var tr = el("tr"); tr.appendChild(el("td", row[0])); tr.appendChild(el("td", row[1])); tb.appendChild(tr);
    });
  }
  function topTable(mapChart) {
    var tb = document.querySelector("#top tbody");
    if (!tb) return;
    D.top.forEach(function (t, rank) {
      var tr = el("tr");
      tr.appendChild(el("td", rank + 1, "num"));
      tr.appendChild(el("td", fmt(t.size), "num"));
      tr.appendChild(el("td", t.category.replace("_", " ")));
      tr.appendChild(el("td", t.dtype || t.shape ? t.dtype + "[" + t.shape + "]" : "\u2014"));
      tr.appendChild(el("td", t.label));
      tr.appendChild(el("td", t.start + " .. " + t.end, "num"));
      tr.appendChild(el("td", t.source || "unknown", "src"));
      tr.addEventListener("mouseenter", function (ev) {
        var lines = [fmt(t.size) + "  " + t.category, t.dtype || t.shape ? t.dtype + "[" + t.shape + "]" : "", "op: " + (t.label || "\u2014"),
                     D.xLabel + "s " + t.start + " .. " + t.end, "source: " + (t.source || "unknown")];
        showTip(ev, lines);
        if (mapChart && t.block >= 0) { mapChart.octx.clearRect(0, 0, mapChart.w, mapChart.h); outline(mapChart, t.block); }
      });
      tr.addEventListener("mouseleave", function () { hideTip(); if (mapChart) mapChart.octx.clearRect(0, 0, mapChart.w, mapChart.h); });
      tb.appendChild(tr);
    });
  }

  try {
    var t0 = performance.now();
    summary();
    legend("legend");
    var rendered = [];
    if (D.points) {
      var st = makeChart("stacked", 280); st.draw = drawStacked; drawStacked(st); wire(st, stackedHover); rendered.push("stacked");
    }
    if (D.allocators.length) {
      var ln = makeChart("lines", 280); ln.draw = drawLines; drawLines(ln); wire(ln, linesHover); rendered.push("lines");
      var lg = document.getElementById("alloc-legend");
      D.allocators.forEach(function (a, k) {
        var s = el("span"), sw = el("i"); sw.style.background = PALETTE[k % PALETTE.length];
        s.appendChild(sw); s.appendChild(el("span", a.name + " (solid: in use, dashed: reserved)")); lg.appendChild(s);
      });
    }
    var mp = null;
    if (B.addr.length || G.addr.length) {
      mp = makeChart("map", 420); mp.draw = drawMap; drawMap(mp); wire(mp, mapHover); rendered.push("map");
    }
    topTable(mp);
    rendered.push("top:" + D.top.length);
    // With #selftest in the address, hover the peak of each chart the way a mouse would and
    // record what the tooltip said and how long it took (headless tests read this back).
    if (location.hash.indexOf("selftest") >= 0) {
      var probes = [];
      charts.forEach(function (ch) {
        var onMap = ch.host.id === "map" && D.top.length;
        var r = ch.over.getBoundingClientRect();
        var px = onMap ? ch.px((Math.max(D.top[0].start, view.x0) + Math.min(D.top[0].end, view.x1) + 1) / 2) : ch.px(D.peak.x + 0.5);
        var py = onMap
          ? ch.h - PAD.b - (D.top[0].address + D.top[0].size / 2) / Math.max(1, D.addressTop) * (ch.h - PAD.t - PAD.b)
          : ch.h / 2;
        var t1 = performance.now();
        ch.over.dispatchEvent(new MouseEvent("mousemove", { clientX: r.left + px, clientY: r.top + py, bubbles: true }));
        probes.push(ch.host.id + "=" + (performance.now() - t1).toFixed(1));
        status.setAttribute("data-tip-" + ch.host.id, tip.textContent);
      });
      status.setAttribute("data-hover-ms", probes.join(","));
      hideTip();
      // Drag across the middle half of the first chart to zoom, then double-click back out.
      if (charts.length) {
        var c0 = charts[0], r0 = c0.over.getBoundingClientRect(), y0 = r0.top + c0.h / 2;
        var xa = r0.left + PAD.l + (c0.w - PAD.l - PAD.r) * 0.25, xb = r0.left + PAD.l + (c0.w - PAD.l - PAD.r) * 0.75;
        var t2 = performance.now();
        c0.over.dispatchEvent(new MouseEvent("mousedown", { clientX: xa, clientY: y0, bubbles: true }));
        c0.over.dispatchEvent(new MouseEvent("mousemove", { clientX: xb, clientY: y0, bubbles: true }));
        c0.over.dispatchEvent(new MouseEvent("mouseup", { clientX: xb, clientY: y0, bubbles: true }));
        var zoomed = view.x0 + ".." + view.x1, zoomMs = (performance.now() - t2).toFixed(1);
        c0.over.dispatchEvent(new MouseEvent("dblclick", { clientX: xb, clientY: y0, bubbles: true }));
        status.setAttribute("data-zoom", zoomed + " in " + zoomMs + " ms; reset " + view.x0 + ".." + view.x1);
      }
    }
    if (!errors.length) {
      status.setAttribute("data-errors", "0");
      status.setAttribute("data-rendered", rendered.join(","));
      status.textContent = "rendered " + rendered.join(", ") + " in " + Math.round(performance.now() - t0) + " ms; "
        + B.addr.length + " blocks drawn, " + G.addr.length + " aggregates";
    }
  } catch (e) {
    fail(e && e.stack ? e.stack : e);
  }
})();

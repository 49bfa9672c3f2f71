/* part 4 (roofline.js): the roofline chart, log-log SVG, from data computed by opfuse/analysis/roofline.py. */

  // ---- roofline -----------------------------------------------------------------------------------------------
  function renderRoofline() {
    var R = data.roofline, root = clear(document.getElementById("roofline-svg"));
    var W = 900, H = 500, left = 96, right = 24, top = 20, bottom = 50;
    root.setAttribute("width", W); root.setAttribute("height", H); root.setAttribute("viewBox", "0 0 " + W + " " + H);
    var lx = [Math.log10(R.x_range[0]), Math.log10(R.x_range[1])], ly = [Math.log10(R.y_range[0]), Math.log10(R.y_range[1])];
    function X(v) { return left + (Math.log10(v) - lx[0]) / (lx[1] - lx[0]) * (W - left - right); }
    function Y(v) { return H - bottom - (Math.log10(v) - ly[0]) / (ly[1] - ly[0]) * (H - top - bottom); }
    var grid = svg("g");
    root.appendChild(grid);
    for (var e = lx[0]; e <= lx[1]; e++) {
      grid.appendChild(svg("line", {"class": "grid", x1: X(Math.pow(10, e)), x2: X(Math.pow(10, e)), y1: top, y2: H - bottom}));
      grid.appendChild(svg("text", {x: X(Math.pow(10, e)), y: H - bottom + 15, "text-anchor": "middle"}, tick(e)));
    }
    for (e = ly[0]; e <= ly[1]; e++) {
      grid.appendChild(svg("line", {"class": "grid", y1: Y(Math.pow(10, e)), y2: Y(Math.pow(10, e)), x1: left, x2: W - right}));
      grid.appendChild(svg("text", {x: left - 6, y: Y(Math.pow(10, e)) + 4, "text-anchor": "end"},
        fmtRate(Math.pow(10, e)).replace(".00 ", " ")));
    }
    root.appendChild(svg("line", {"class": "axis", x1: left, x2: W - right, y1: H - bottom, y2: H - bottom}));
    root.appendChild(svg("line", {"class": "axis", x1: left, x2: left, y1: top, y2: H - bottom}));
    root.appendChild(svg("text", {x: (left + W - right) / 2, y: H - 12, "text-anchor": "middle"},
      "arithmetic intensity (FLOPs/Byte, log)"));
    root.appendChild(svg("text", {x: 14, y: (top + H - bottom) / 2, transform: "rotate(-90 14 " + (top + H - bottom) / 2 + ")",
      "text-anchor": "middle"}, "attained FLOP/s (log)"));

    var bw = R.memory_bandwidth, xmin = R.x_range[0], xmax = R.x_range[1];
    R.ceilings.forEach(function (c, i) {
      var start = Math.max(xmin, R.y_range[0] / bw);
      var pts = i === 0 ? [[start, bw * start], [c.ridge, c.flops], [xmax, c.flops]] : [[c.ridge, c.flops], [xmax, c.flops]];
      root.appendChild(svg("polyline", {"class": "roof" + (i ? " vector" : ""), points: pts.map(function (p) {
        return X(p[0]) + "," + Y(p[1]); }).join(" ")}));
      root.appendChild(svg("text", {x: X(xmax) - 6, y: Y(c.flops) + (i ? 15 : -6), "text-anchor": "end"},
        c.name + ": " + fmtRate(c.flops)));
    });
    var slopeX = Math.max(xmin * 3, R.y_range[0] * 10 / bw), sx = X(slopeX), sy = Y(bw * slopeX);
    var angle = Math.atan2(Y(bw * slopeX * 10) - sy, X(slopeX * 10) - sx) * 180 / Math.PI;
    root.appendChild(svg("text", {x: sx, y: sy - 6, transform: "rotate(" + angle.toFixed(1) + " " + sx + " " + sy + ")"},
      "memory bandwidth " + (bw / 1e12).toFixed(2) + " TB/s"));

    var points = svg("g");
    root.appendChild(points);
    R.points.forEach(function (p) {
      var shape;
      if (p.series === "op") {
        shape = svg("circle", {"class": "pt-op", cx: X(p.x), cy: Y(p.y), r: 3.2});
      } else {
        var group = groupsByName[p.group];
        shape = svg("circle", {"class": "pt-group" + (p.source === "measured" ? " measured" : ""), cx: X(p.x), cy: Y(p.y), r: 5.5,
          fill: kindColor(group.kind), "fill-opacity": 0.85, "data-group": p.group});
      }
      shape.appendChild(svg("title", {}, (p.series === "op" ? "op before fusion: " : "kernel after fusion: ") + p.label + " (" +
        p.detail + ")\n" + p.x.toFixed(2) + " FLOPs/Byte, " + fmtRate(p.y) + " (" + p.source + " " + fmtTime(p.time) + ")"));
      points.appendChild(shape);
    });
    points.addEventListener("click", function (event) {
      var hit = event.target.closest("[data-group]");
      if (hit) select(hit.getAttribute("data-group"), true);
    });
    var key = svg("g", {transform: "translate(" + (W - right - 150) + "," + (H - bottom - 52) + ")"});
    key.appendChild(svg("circle", {"class": "pt-op", cx: 5, cy: 0, r: 3.2}));
    key.appendChild(svg("text", {x: 14, y: 4}, "op, before fusion"));
    key.appendChild(svg("circle", {"class": "pt-group", cx: 5, cy: 18, r: 5.5, fill: "#4e79a7"}));
    key.appendChild(svg("text", {x: 14, y: 22}, "kernel, after fusion"));
    key.appendChild(svg("text", {x: 0, y: 40}, "(colour: fusion kind)"));
    root.appendChild(key);
    var measured = R.points.filter(function (p) { return p.source === "measured"; }).length;
    document.getElementById("roofline-caption").textContent = "Each op of the captured graph (hollow) and each kernel after " +
      "fusion (filled) at its FLOPs per byte moved and its " + (measured ? measured + " measured, the rest predicted" : "predicted") +
      " FLOP/s. Roofs: " + R.hardware + " datasheet peaks; predicted times include the launch overhead (" +
      fmtTime(data.hardware.launch_overhead) + " a kernel), which keeps small kernels far below them. Not drawn (no FLOPs): " +
      R.skipped.op + " ops, " + R.skipped.group + " kernels. Click a kernel to find it in the graph.";
  }
  function tick(e) {
    var v = Math.pow(10, e);
    return v >= 1e3 ? (v / 1e3) + "k" : String(Number(v.toPrecision(1)));
  }

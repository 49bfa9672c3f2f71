/* part 2 (graph.js): the model graph as SVG. Python computed each block's layer, order and rows; here they
 * become pixels, so a collapsed group can shrink. Skip connections run in lanes right of what they pass. */

  // ---- the graph ----------------------------------------------------------------------------------------------
  var NODE_W = 136, NODE_H = 30, PAD = 7, HEADER = 17, GAP = 8, BLOCK_GAP = 22, LAYER_GAP = 34, MARGIN = 16;
  var collapsed = {};          // block id -> true
  var selected = null;         // pinned group name
  var searchTerm = "";
  var nodePos = {}, blockPos = {};

  function isBoxed(block) { return block.group !== null && block.kind !== "view"; }
  function blockSize(block) {
    if (!isBoxed(block)) return {w: NODE_W, h: NODE_H};
    if (collapsed[block.id]) return {w: NODE_W + 2 * PAD, h: HEADER + NODE_H + 2 * PAD};
    var cols = Math.max.apply(null, block.rows.map(function (r) { return r.length; }));
    var rows = block.rows.length;
    return {w: cols * NODE_W + (cols - 1) * GAP + 2 * PAD, h: HEADER + rows * NODE_H + (rows - 1) * GAP + 2 * PAD};
  }

  function layout() {
    var layers = [];
    G.blocks.forEach(function (b) { (layers[b.layer] = layers[b.layer] || []).push(b); });
    var widths = layers.map(function (members) {
      members.sort(function (a, b) { return a.order - b.order; });
      return members.reduce(function (w, b) { return w + blockSize(b).w; }, 0) + BLOCK_GAP * (members.length - 1);
    });
    var maxWidth = Math.max.apply(null, widths.concat([NODE_W]));
    var y = MARGIN;
    nodePos = {}; blockPos = {};
    layers.forEach(function (members, li) {
      var x = MARGIN + (maxWidth - widths[li]) / 2, height = 0;
      members.forEach(function (b) {
        var size = blockSize(b);
        blockPos[b.id] = {x: x, y: y, w: size.w, h: size.h};
        placeNodes(b, x, y, size);
        x += size.w + BLOCK_GAP;
        height = Math.max(height, size.h);
      });
      y += height + LAYER_GAP;
    });
    return {width: maxWidth + 2 * MARGIN, height: y - LAYER_GAP + MARGIN};
  }

  // node index -> layer of its block, and the blocks of each layer (for routing skip connections)
  var blockLayer = {}, layerBlocks = [];
  G.blocks.forEach(function (b) {
    (layerBlocks[b.layer] = layerBlocks[b.layer] || []).push(b);
    b.rows.forEach(function (row) { row.forEach(function (n) { blockLayer[n] = b.layer; }); });
  });

  function laneFor(x1, x2, fromLayer, toLayer, y1, y2, lanes) {
    var lane = x2 + NODE_W / 2 + 10, moved = true;
    while (moved) {   // right of every block in between that the path from x1 to the lane would cross
      moved = false;
      for (var l = fromLayer + 1; l < toLayer; l++) {
        layerBlocks[l].forEach(function (b) {
          var p = blockPos[b.id];
          if (p.x < lane && p.x + p.w + 10 > lane && p.x + p.w > x1 - NODE_W / 2) { lane = p.x + p.w + 10; moved = true; }
        });
      }
    }
    moved = true;
    while (moved) {   // keep lanes that run side by side apart
      moved = false;
      for (var i = 0; i < lanes.length; i++) {
        var other = lanes[i];
        if (Math.abs(other.x - lane) < 6 && other.y1 < y2 && other.y2 > y1) { lane = other.x + 7; moved = true; }
      }
    }
    lanes.push({x: lane, y1: y1, y2: y2});
    return lane;
  }

  function placeNodes(block, x, y, size) {
    if (!isBoxed(block)) { nodePos[block.rows[0][0]] = {x: x, y: y, hidden: false}; return; }
    if (collapsed[block.id]) {
      block.rows.forEach(function (row) { row.forEach(function (n) {
        nodePos[n] = {x: x + PAD, y: y + HEADER + PAD, hidden: true};
      }); });
      return;
    }
    block.rows.forEach(function (row, r) {
      var rowWidth = row.length * NODE_W + (row.length - 1) * GAP;
      var x0 = x + (size.w - rowWidth) / 2;
      row.forEach(function (n, c) {
        nodePos[n] = {x: x0 + c * (NODE_W + GAP), y: y + HEADER + PAD + r * (NODE_H + GAP), hidden: false};
      });
    });
  }

  function drawGraph() {
    var root = clear(document.getElementById("graph-svg"));
    var size = layout();
    root.setAttribute("width", size.width);
    root.setAttribute("height", size.height);
    root.setAttribute("viewBox", "0 0 " + size.width + " " + size.height);
    var boxes = svg("g", {"class": "boxes"}), edges = svg("g", {"class": "edges"}), nodes = svg("g", {"class": "nodes"});
    root.appendChild(boxes); root.appendChild(edges); root.appendChild(nodes);

    G.blocks.forEach(function (block) { if (isBoxed(block)) boxes.appendChild(drawBox(block)); });
    var seen = {}, lanes = [], right = size.width;
    G.edges.forEach(function (e) {
      var a = nodePos[e[0]], b = nodePos[e[1]];
      var ga = G.nodes[e[0]].group, gb = G.nodes[e[1]].group;
      if ((a.hidden || b.hidden) && ga === gb) return;     // inside a collapsed group
      var x1 = a.x + NODE_W / 2, y1 = a.y + NODE_H, x2 = b.x + NODE_W / 2, y2 = b.y;
      var key = x1 + "," + y1 + ">" + x2 + "," + y2;
      if (seen[key]) return;
      seen[key] = true;
      var d, span = blockLayer[e[1]] - blockLayer[e[0]];
      if (span > 1) {   // a skip connection: route it in a lane right of the layers it passes
        var lane = laneFor(Math.min(x1, x2), Math.max(x1, x2), blockLayer[e[0]], blockLayer[e[1]], y1, y2, lanes);
        right = Math.max(right, lane + MARGIN);
        var c = Math.min(20, LAYER_GAP / 2);
        d = "M" + x1 + " " + y1 + " C" + x1 + " " + (y1 + c) + " " + lane + " " + y1 + " " + lane + " " + (y1 + 2 * c) +
          " L" + lane + " " + (y2 - 2 * c) + " C" + lane + " " + y2 + " " + x2 + " " + (y2 - c) + " " + x2 + " " + y2;
      } else {
        var dy = Math.max(12, Math.min(60, (y2 - y1) / 2));
        d = "M" + x1 + " " + y1 + " C" + x1 + " " + (y1 + dy) + " " + x2 + " " + (y2 - dy) + " " + x2 + " " + y2;
      }
      edges.appendChild(svg("path", {"class": "edge" + (span > 1 ? " skip" : ""), "d": d}));
    });
    if (right > size.width) {
      root.setAttribute("width", right);
      root.setAttribute("viewBox", "0 0 " + right + " " + size.height);
    }
    G.nodes.forEach(function (node, i) { if (!nodePos[i].hidden) nodes.appendChild(drawNode(node, i)); });
    applySearch();
    markSelected();
  }

  function drawBox(block) {
    var pos = blockPos[block.id], group = groupsByName[block.group], color = kindColor(block.kind);
    var g = svg("g", {"class": "group kind-" + kindClass(block.kind), "data-group": block.group});
    g.appendChild(svg("rect", {"class": "group-box", x: pos.x, y: pos.y, width: pos.w, height: pos.h, rx: 6,
      fill: color, "fill-opacity": 0.13, stroke: color}));
    var count = group.nodes.length;
    var label = group.name + " · " + group.kind;
    g.appendChild(svg("text", {"class": "group-label", x: pos.x + 6, y: pos.y + 12}, truncate(label, Math.floor((pos.w - 24) / 6.6))));
    if (collapsed[block.id]) {
      g.appendChild(svg("rect", {x: pos.x + PAD, y: pos.y + HEADER + PAD, width: NODE_W, height: NODE_H, rx: 4,
        fill: "#fff", stroke: color}));
      g.appendChild(svg("text", {x: pos.x + PAD + 5, y: pos.y + HEADER + PAD + 12},
        truncate(group.nodes.map(function (n) { return G.nodes[nodeIndex[n]] ? G.nodes[nodeIndex[n]].op : n; }).join("+"), 21)));
      g.appendChild(svg("text", {"class": "sub", x: pos.x + PAD + 5, y: pos.y + HEADER + PAD + 24}, count + " ops (collapsed)"));
    }
    g.appendChild(svg("title", {}, group.name + " (" + group.kind + "): " + group.nodes.join(", ") + "\n" + group.reason));
    var toggle = svg("g", {"class": "toggle", "data-toggle": block.id});
    toggle.appendChild(svg("rect", {x: pos.x + pos.w - 15, y: pos.y + 3, width: 11, height: 11, rx: 2}));
    toggle.appendChild(svg("text", {x: pos.x + pos.w - 12.5, y: pos.y + 12.5}, collapsed[block.id] ? "+" : "−"));
    g.appendChild(toggle);
    return g;
  }

  function drawNode(node, i) {
    var pos = nodePos[i];
    var cls = "node" + (node.view ? " view" : "") + (node.opaque ? " opaque" : "") + (node.op === "input" ? " input" : "");
    var g = svg("g", {"class": cls, "data-node": node.name});
    if (node.group) g.setAttribute("data-group", node.group);
    g.appendChild(svg("rect", {x: pos.x, y: pos.y, width: NODE_W, height: NODE_H, rx: 4}));
    var title = node.opaque ? node.op + " (PyTorch)" : node.op;
    g.appendChild(svg("text", {x: pos.x + 5, y: pos.y + 12}, truncate(title, 21)));
    g.appendChild(svg("text", {"class": "sub", x: pos.x + 5, y: pos.y + 24}, truncate(node.name, 23)));
    g.appendChild(svg("title", {}, node.name + " [" + node.op + "] " + node.type +
      (node.target ? "\ntarget: " + node.target : "") + (node.source && node.source !== node.name ? "\nfrom " + node.source : "")));
    return g;
  }

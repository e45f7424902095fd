// Render every report chart: each div.tilax-chart has its Vega-Lite spec in the
// <script type="application/json" data-chart-for="ID"> beside it. vegaEmbed comes from the
// vendored bundle (assets/vendor/vega-bundle.js), so nothing is fetched from the network.
(function () {
  "use strict";
  const EMBED_OPTIONS = {
    renderer: "svg",
    actions: false,
  };

  function renderCharts() {
    for (const container of document.querySelectorAll("div.tilax-chart")) {
      if (container.dataset.rendered) continue;
      const specNode = document.querySelector(
        `script[data-chart-for="${container.id}"]`
      );
      if (!specNode) continue;
      container.dataset.rendered = "pending";
      const spec = JSON.parse(specNode.textContent);
      window
        .vegaEmbed(container, spec, EMBED_OPTIONS)
        .then(() => { container.dataset.rendered = "yes"; })
        .catch((error) => {
          container.dataset.rendered = "failed";
          container.textContent = `This chart failed to render: ${error}`;
          console.error(error);
        });
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", renderCharts);
  } else {
    renderCharts();
  }
})();
